"""AsyncLLM: an asyncio front end that streams requests through one running engine."""
import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nanovllm.config import config_from_kwargs
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request_checks import Prompt, validate_request
from nanovllm.engine.structured_outputs import StructuredOutputs
from nanovllm.lora.adapter import load_adapter
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.engine_loop import EngineStats, EngineThread, Update
from nanovllm.serve.engine_process import EngineProcess
from nanovllm.utils.tokenizer import eos_token_ids, load_tokenizer


class EngineDeadError(RuntimeError):
    """The engine is not running: it was shut down, or its process died."""


@dataclass
class RequestOutput:
    """One increment of a request: its new tokens and text; finish_reason ends the stream."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int  # so far, this increment included
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last output
    metrics: dict | None = None  # the engine's {"ttft_s", "latency_s"} on the last output
    # {token_id: logprob} per new token (the top SamplingParams.logprobs and the sampled one);
    # None when the request did not ask
    new_logprobs: list[dict[int, float]] | None = None
    # on the last output of a request that asked: per prompt token (the first None)
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class _Stream:
    """A request's state on the event loop: what the engine thread delivered, not yet read."""

    detokenizer: IncrementalDetokenizer | None  # None: SamplingParams.detokenize is False
    token_ids: list[int] = field(default_factory=list)  # completion tokens read so far
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[dict[int, float]] | None = None  # a list when the request asked
    final: dict | None = None
    error: str | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class AsyncLLM:
    """`async for out in llm.generate(prompt, params, request_id)` streams one request; the
    engine runs in a process of its own (as vLLM's engine core), or in a thread of this one,
    where `engine` is the LLMEngine (tests read its state)."""

    def __init__(self, model: str, engine_process: bool = True, **kwargs):
        config = config_from_kwargs(model, kwargs)  # a bad keyword fails before any process
        self.config = config
        self.max_model_len = config.max_model_len
        self.tokenizer = load_tokenizer(config.tokenizer)
        # Compiles structured outputs here, before queueing, so a grammar that does not compile
        # is a ValueError of generate() (a 400) wherever the engine runs; the engine compiles
        # again for its matchers (xgrammar's objects do not cross processes).
        self.grammars = StructuredOutputs(self.tokenizer, config.hf_config.vocab_size,
                                          eos_token_ids(self.tokenizer, config.hf_config,
                                                        config.model))
        self.stats = EngineStats()
        self._streams: dict[int, _Stream] = {}
        self._handles: dict[str, int] = {}  # request id -> handle of its stream
        self._next_handle = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine: LLMEngine | None = None
        if engine_process:  # its updates are read in the event loop's thread: no hand-off
            self._engine = EngineProcess(model, kwargs, self._deliver)
        else:
            self.engine = LLMEngine(model, **kwargs)
            self._engine = EngineThread(self.engine, self._publish)
        self.limits = self._engine.limits

    @property
    def is_running(self) -> bool:
        """Whether the engine is stepping (False after shutdown or a crash)."""
        return self._engine.is_alive()

    def check_lora(self, request: LoRARequest) -> None:
        """Read and check an adapter here, so that a bad one is a ValueError (FileNotFoundError
        for a path) before any request names it."""
        if not self.config.enable_lora:
            raise ValueError("LoRA is not enabled: start the server with --enable-lora")
        load_adapter(request, self.config.hf_config, self.config.max_lora_rank)

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Queue a request (through `lora_request`'s adapter, one check_lora passed) and yield
        its outputs until one has a finish_reason."""
        # A bad request raises ValueError before it is queued; leaving early aborts it.
        if not self.is_running:
            raise EngineDeadError("the engine is not running (it was shut down or it died)")
        token_ids, _ = validate_request(prompt, params, self.limits, self.tokenizer.encode,
                                        self.grammars)
        if params.n != 1:  # the engine would run n completions and stream only the first
            raise ValueError(f"n={params.n}: a stream is one completion; queue one request per "
                             f"completion (outputs.completion_params(params))")
        if request_id in self._handles:
            raise ValueError(f"request_id={request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._streams:
                raise RuntimeError("AsyncLLM serves one event loop at a time; requests of "
                                   "another loop are still open")
            self._loop = loop
            self._engine.attach(loop)
        handle = next(self._next_handle)
        stream = self._streams[handle] = _Stream(
            IncrementalDetokenizer(self.tokenizer, params.stop_strings,
                                   skip_special_tokens=params.skip_special_tokens)
            if params.detokenize else None,
            pending_logprobs=None if params.logprobs is None else [])
        self._handles[request_id] = handle
        self._engine.add(handle, token_ids, params, lora_request)
        finished = False
        try:
            while not finished:
                await stream.ready.wait()
                stream.ready.clear()
                try:
                    out = _read(stream, request_id, len(token_ids))
                except RuntimeError as e:
                    if self.is_running:  # the engine failed this request's step
                        raise
                    raise EngineDeadError(str(e)) from None
                finished = out.finish_reason is not None
                yield out
        finally:
            del self._streams[handle], self._handles[request_id]
            if not finished:  # an error, a cancelled task or a consumer that stopped reading
                self._engine.abort(handle)

    async def abort(self, request_id: str) -> None:
        """Cancel a request; when this returns its KV blocks are free. Unknown ids are ignored."""
        handle = self._handles.get(request_id)
        if handle is None:
            return
        done = asyncio.get_running_loop().create_future()

        def set_done() -> None:  # in the engine thread, or in this loop's for a process
            try:
                done.get_loop().call_soon_threadsafe(done.set_result, None)
            except RuntimeError:  # the loop has closed: nobody awaits this any more
                pass

        self._engine.abort(handle, set_done)
        await done

    def shutdown(self) -> None:
        """Fail the open requests, stop the engine loop, then free the engine; idempotent."""
        self._engine.shutdown()
        if self.engine is not None:
            self.engine.shutdown()

    def _publish(self, updates: list[Update], stats: EngineStats) -> None:
        """Called by the engine thread: hand the updates to the event loop."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._deliver, updates, stats)
        except RuntimeError:  # the event loop is closed: nobody waits for these any more
            pass

    def _deliver(self, updates: list[Update], stats: EngineStats) -> None:
        self.stats = stats
        for update in updates:
            stream = self._streams.get(update.handle)
            if stream is None:  # its consumer left: an abort is on its way to the engine
                continue
            stream.pending += update.new_token_ids
            if update.new_logprobs is not None:
                stream.pending_logprobs += update.new_logprobs
            stream.final = stream.final or update.final
            stream.error = stream.error or update.error
            stream.ready.set()


def _read(stream: _Stream, request_id: str, num_prompt_tokens: int) -> RequestOutput:
    """Take what the engine delivered and turn it into the next output."""
    if stream.error is not None:
        raise RuntimeError(stream.error)
    new_token_ids, stream.pending = stream.pending, []
    new_logprobs = stream.pending_logprobs
    if new_logprobs is not None:
        stream.pending_logprobs = []
    stream.token_ids += new_token_ids
    final = stream.final or {}
    if stream.detokenizer is None:  # detokenize=False: the final text is "" too
        text = ""
    elif stream.final is None:
        text = stream.detokenizer.update(stream.token_ids)
    else:
        text = stream.detokenizer.finish(final["text"]) if final["text"] is not None else ""
    return RequestOutput(request_id, new_token_ids, text, num_prompt_tokens,
                         len(stream.token_ids), final.get("finish_reason"), final.get("metrics"),
                         new_logprobs, final.get("prompt_logprobs"))
