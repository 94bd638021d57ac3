"""What the /v1 routes do: requests to SamplingParams, AsyncLLM outputs to OpenAI responses."""
import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from nanovllm.engine.outputs import completion_params
from nanovllm.engine.request_checks import prompt_token_ids, truncate_prompt, validate_request
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.async_llm import AsyncLLM, RequestOutput
from nanovllm.serve.openai.chat_template import chat_prompt
from nanovllm.serve.openai.errors import APIError, bad_request
from nanovllm.serve.openai.logprobs import LogprobsFormat
from nanovllm.serve.openai.lora_modules import (
    LoadLoRAAdapterRequest,
    LoRAModules,
    UnloadLoRAAdapterRequest,
)
from nanovllm.serve.openai.metrics import ServerMetrics
from nanovllm.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
)
from nanovllm.serve.openai.responses import Choice, ChoiceOutput, ResponseFormat
from nanovllm.serve.openai.structured import check_compiles
from nanovllm.serve.openai.tool_calls import output_parser
from nanovllm.serve.openai.validation import (
    check_context,
    check_fields,
    unknown_fields,
)

logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


class OpenAIServing:
    """The route handlers over one AsyncLLM serving one model name and its LoRA adapters
    (`lora_modules`: name -> PEFT directory, checked here)."""

    def __init__(self, llm: AsyncLLM, model_name: str, lora_modules: dict[str, str] | None = None):
        self.llm = llm
        self.model_name = model_name
        self.metrics = ServerMetrics(model_name)
        self.created = int(time.time())
        self.loras = LoRAModules(llm, model_name)
        for name, path in (lora_modules or {}).items():
            self.loras.load(name, path)

    def model_card(self, lora: LoRARequest | None = None) -> dict:
        """OpenAI's model object, with vLLM's max_model_len (and, for an adapter, its parent)."""
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "nanovllm", "max_model_len": self.llm.max_model_len}
        if lora is not None:
            card.update(id=lora.lora_name, root=lora.lora_path, parent=self.model_name)
        return card

    async def models(self) -> dict:
        cards = [self.model_card()] + [self.model_card(r) for r in self.loras.requests.values()]
        return {"object": "list", "data": cards}

    async def model(self, model_id: str) -> dict:
        """GET /v1/models/{model_id}: the model object, or a 404."""
        try:
            return self.model_card(self.loras.resolve(model_id))
        except APIError:
            raise APIError(404, f"The model {model_id!r} does not exist; this server serves "
                                f"{[self.model_name, *self.loras.requests]}", "not_found_error",
                           "model") from None

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """vLLM's POST /v1/load_lora_adapter: the adapter is checked, then served by its name."""
        warn_ignored(unknown_fields(body))
        try:
            self.loras.load(body.lora_name, body.lora_path)
        except (ValueError, FileNotFoundError) as e:
            raise APIError(400, str(e), "invalid_request_error", "lora_path") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        warn_ignored(unknown_fields(body))
        self.loras.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def prometheus_metrics(self) -> Response:
        return Response(self.metrics.render(self.llm.stats), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        warn_ignored(body.ignored_fields)
        lora = self.loras.resolve(body.model)
        try:
            check_fields(body, self.llm.max_model_len)
            prompts = body.prompts()
            params = body.sampling_params(16, self.llm.config.sampling_defaults)  # OpenAI's 16
            self._check_structure(body, params)
        except ValueError as e:
            raise bad_request(e) from None
        return await self._serve(request, body, prompts, params, chat=False, lora=lora)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        warn_ignored(body.ignored_fields)
        lora = self.loras.resolve(body.model)
        try:
            check_fields(body, self.llm.max_model_len)  # before the template renders
            prompt = truncate_prompt(chat_prompt(self.llm.tokenizer, body),
                                     body.truncate_prompt_tokens, self.llm.max_model_len)
            # the rest of the context; a prompt that fills it is refused in _serve
            params = body.sampling_params(max(1, self.llm.max_model_len - len(prompt)),
                                          self.llm.config.sampling_defaults)
            self._check_structure(body, params)
        except ValueError as e:
            raise bad_request(e) from None
        return await self._serve(request, body, [prompt], params, chat=True, lora=lora)

    def _check_structure(self, body: _SamplingRequest, params: SamplingParams) -> None:
        """Compile the request's grammar here, so one that does not compile is a 400 naming
        the field that asked for it (the engine, maybe in another process, reuses nothing)."""
        if params.structured_outputs is not None:
            check_compiles(self.llm.grammars, params.structured_outputs, body.structure()[1])

    async def _serve(self, request: Request, body: _SamplingRequest,
                     prompts: list[str | list[int]], params: SamplingParams,
                     chat: bool, lora: LoRARequest | None = None) -> Response:
        """Choice j * n + i is completion i of prompt j: one engine request each."""
        tokenizer = self.llm.tokenizer
        try:  # once per prompt for its n completions: each then gets the token ids
            token_ids, cut = zip(*(self._prompt_ids(p, params, body, chat) for p in prompts))
        except ValueError as e:
            raise bad_request(e) from None
        logprobs = None
        if params.logprobs is not None or body.prompt_logprobs is not None:
            logprobs = LogprobsFormat(tokenizer, chat, params.logprobs or 0)
        echo = None
        if getattr(body, "echo", False):  # completions: the prompt leads the text (and logprobs)
            echo = [(p if isinstance(p, str) and not shortened else tokenizer.decode(ids), ids)
                    for p, ids, shortened in zip(prompts, token_ids, cut)]
        tools = (output_parser(body.effective_tool_choice(), body.parallel_tool_calls) if chat
                 else None)
        fmt = ResponseFormat(self.model_name, chat, params.n, logprobs, echo, len(prompts),
                             body.prompt_logprobs, body.continuous_usage, tools)
        # The later completions of a prompt hit its full blocks in the engine's prefix cache.
        outputs = interleave([
            self.metrics.track(self.llm.generate(ids, p, f"{fmt.id}-{j * params.n + i}", lora),
                               primary=i == 0)
            for j, ids in enumerate(token_ids) for i, p in enumerate(completion_params(params))])
        try:
            # A bad request is a 400, not a stream: generate() validates before its first output.
            first = await until_disconnect(request, anext(outputs))
        except ValueError as e:
            raise bad_request(e) from None
        except ClientDisconnected:  # the cancelled anext() closed `outputs`, aborting all
            return Response(status_code=499)  # nobody reads it
        if body.stream:
            return StreamingResponse(fmt.sse(first, outputs, body.include_usage),
                                     media_type="text/event-stream")
        try:
            choices = await until_disconnect(request, collect(first, outputs, fmt.num_choices))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(fmt.full(choices))

    def _prompt_ids(self, prompt: str | list[int], params: SamplingParams,
                    body: _SamplingRequest, chat: bool) -> tuple[list[int], bool]:
        """(The prompt's token ids, once it and max_tokens fit the context, as the engine
        checks it; whether truncate_prompt_tokens shortened them)."""
        tokenizer = self.llm.tokenizer
        ids = prompt_token_ids(prompt, functools.partial(
            tokenizer.encode, add_special_tokens=body.add_special_tokens))
        whole = len(ids)
        if not chat:  # a chat prompt comes truncated: its default max_tokens needed that
            ids = truncate_prompt(ids, body.truncate_prompt_tokens, self.llm.max_model_len)
        check_context(len(ids), body.requested_max_tokens, body.max_tokens_field,
                      self.llm.max_model_len, "messages" if chat else "prompt")
        return validate_request(ids, params, self.llm.limits, tokenizer.encode)[0], \
            len(ids) < whole


def warn_ignored(fields: list[str]) -> None:
    """Name the fields a request carried that the server does not read (vLLM's warning): a
    misspelt field would otherwise change nothing without a word."""
    if fields:
        logger.warning("The following fields were present in the request but ignored: %s",
                       fields)


async def collect(first: ChoiceOutput, outputs: AsyncIterator[ChoiceOutput],
                  n: int) -> list[Choice]:
    """Every choice whole, in index order."""
    choices = [Choice() for _ in range(n)]
    choices[first[0]].add(first[1])
    async with aclosing(outputs):
        async for index, out in outputs:
            choices[index].add(out)
    return choices


async def interleave(streams: list[AsyncIterator[RequestOutput]]
                     ) -> AsyncIterator[ChoiceOutput]:
    """(index, output) of the streams' outputs as they come. An error of one stream is raised
    here; closing this or an error closes every stream, which aborts its request."""
    if len(streams) == 1:  # the common case, without tasks
        async with aclosing(streams[0]) as outputs:
            async for out in outputs:
                yield 0, out
        return
    # Bounded: while the reader is slow, a stream's engine updates pile up in AsyncLLM and
    # come out as one output, as they do for a single stream.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    tasks = [asyncio.ensure_future(_pump(index, stream, queue))
             for index, stream in enumerate(streams)]
    try:
        for _ in streams:  # until every stream has ended
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()  # in AsyncLLM.generate: aborts the request unless it is finished
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(index: int, stream: AsyncIterator[RequestOutput], queue: asyncio.Queue) -> None:
    """Put (index, output) per output of `stream` into `queue`, then None, or its error."""
    try:
        async with aclosing(stream):
            async for out in stream:
                await queue.put((index, out))
    except Exception as e:
        await queue.put(e)
    else:
        await queue.put(None)


async def until_disconnect(request: Request, awaitable: Awaitable):
    """Await `awaitable`, cancelling it (and so aborting its request) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnected


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
