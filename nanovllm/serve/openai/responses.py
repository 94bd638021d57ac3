"""OpenAI's response bodies: whole (completion, chat.completion) or as server-sent events."""
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from uuid import uuid4

from nanovllm.serve.async_llm import RequestOutput
from nanovllm.serve.openai.errors import error_body
from nanovllm.serve.openai.logprobs import LogprobsFormat

# (choice index, its next output): what a request's n completions yield, interleaved
ChoiceOutput = tuple[int, RequestOutput]


def sse(payload: dict | str) -> str:
    """One server-sent event's data line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclass
class Choice:
    """One completion gathered whole, for a response that is not streamed."""

    last: RequestOutput | None = None
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # a list once an output brought some

    def add(self, out: RequestOutput) -> None:
        self.last = out
        self.pieces.append(out.new_text)
        self.token_ids += out.new_token_ids
        if out.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += out.new_logprobs


class ResponseFormat:
    """Builds one request's response objects, for /v1/completions or /v1/chat/completions;
    `logprobs` formats the tokens' logprobs when the request asked for them."""

    def __init__(self, model_name: str, chat: bool, n: int = 1,
                 logprobs: LogprobsFormat | None = None,
                 echo: list[tuple[str, list[int]]] | None = None, num_prompts: int = 1,
                 prompt_logprobs: int | None = None, continuous_usage: bool = False,
                 tools: Callable[[str], tuple[str | None, list[dict]]] | None = None):
        self.chat = chat
        self.n = n  # choices per prompt: choice j * n + i is completion i of prompt j
        self.num_choices = n * num_prompts
        self.logprobs = logprobs
        self.echo = echo  # per prompt, (text, token ids): they lead each of its choices
        self._echoed: set[int] = set()  # streamed choices whose prompt went out
        self.prompt_logprobs = prompt_logprobs  # vLLM's: top k per prompt token, when asked
        self.continuous_usage = continuous_usage  # a stream's every chunk carries usage (vLLM)
        self.tools = tools  # chat with tools: text -> (content, tool_calls), not streamed
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid4().hex}"
        self.model = model_name
        self.created = int(time.time())

    def full(self, choices: list[Choice]) -> dict:
        """The whole answer at once: choice i is completion i."""
        body = []
        for index, choice in enumerate(choices):
            text, token_ids, entries = "".join(choice.pieces), choice.token_ids, choice.logprobs
            if self.echo is not None:
                first = index - index % self.n
                echo_text, echo_ids = self.echo[index // self.n]
                text = echo_text + text
                # completion 0 alone computes the prompt's logprobs (outputs.completion_params)
                prompt_logprobs = choices[first].last.prompt_logprobs
                if entries is not None and prompt_logprobs is not None:
                    token_ids, entries = echo_ids + token_ids, prompt_logprobs + entries
            logprobs = None
            if self.logprobs is not None and entries is not None:
                logprobs = self.logprobs.full(token_ids, entries)
            reason, message = choice.last.finish_reason, {"role": "assistant", "content": text}
            content, calls = (text, []) if self.tools is None else self.tools(text)
            if calls:  # OpenAI's shape: the calls, the content left, finish_reason tool_calls
                message = {**message, "content": content, "tool_calls": calls}
                reason = "tool_calls"
            body.append(self._choice(index, text, logprobs, reason, message, "message"))
            if self.prompt_logprobs is not None and not self.chat:
                body[-1]["prompt_logprobs"] = self._prompt_logprobs(choices, index)
        full = self._body(body, usage=usage([c.last for c in choices], self.n), stream=False)
        if self.prompt_logprobs is not None and self.chat:  # vLLM: beside the choices
            full["prompt_logprobs"] = self._prompt_logprobs(choices, 0)
        return full

    def _prompt_logprobs(self, choices: list[Choice], index: int) -> list | None:
        """The prompt logprobs of choice `index`'s prompt (its completion 0 computed them)."""
        entries = choices[index - index % self.n].last.prompt_logprobs
        return None if entries is None else self.logprobs.prompt(entries, self.prompt_logprobs)

    def chunk(self, index: int, out: RequestOutput) -> dict:
        """One streamed piece of choice `index`, with the logprobs of the tokens it brings; with
        echo, a choice's first piece starts with its prompt (vLLM)."""
        logprobs = None
        if self.logprobs is not None and out.new_logprobs is not None:
            logprobs = self.logprobs.delta(index, out.new_token_ids, out.new_logprobs)
        text = out.new_text
        if self.echo is not None and index not in self._echoed:
            self._echoed.add(index)
            text = self.echo[index // self.n][0] + text
        body = self._body([self._choice(index, text, logprobs, out.finish_reason,
                                        {"content": text}, "delta")])
        if self.continuous_usage:  # this choice's tokens so far (vLLM)
            body["usage"] = usage_body(out.num_prompt_tokens, out.num_output_tokens)
        return body

    def _choice(self, index: int, text: str, logprobs: dict | None, reason: str | None,
                message: dict, key: str) -> dict:
        """A choice object: chat's holds `message` under `key`, a completion's the text."""
        content = {key: message} if self.chat else {"text": text}
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": reason}

    def role_chunk(self, index: int, num_prompt_tokens: int) -> dict:
        """A chat stream's first chunk of a choice: the role."""
        body = self._body([{"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}])
        if self.continuous_usage:
            body["usage"] = usage_body(num_prompt_tokens, 0)
        return body

    async def sse(self, first: ChoiceOutput, outputs: AsyncIterator[ChoiceOutput],
                  include_usage: bool) -> AsyncIterator[str]:
        """The stream: chat's role chunks, a chunk per output of any choice (its text may be
        empty while text is held back, as in vLLM), then `data: [DONE]`; with
        continuous_usage, every chunk carries its choice's usage so far."""
        # Closing it (the client left) closes `outputs`, which aborts the requests.
        lasts = {first[0]: first[1]}
        if self.chat:
            for index in range(self.num_choices):
                yield sse(self.role_chunk(index, first[1].num_prompt_tokens))
        async with aclosing(outputs):
            try:
                yield sse(self.chunk(*first))
                async for index, out in outputs:
                    lasts[index] = out
                    yield sse(self.chunk(index, out))
            except RuntimeError as e:  # the engine failed a request; the server goes on
                yield sse({"error": error_body(e)})
                include_usage = False  # no usage for a failed request
        if include_usage:
            yield sse(self._body([], usage=usage([lasts[i] for i in sorted(lasts)], self.n)))
        yield sse("[DONE]")

    def _body(self, choices: list[dict], usage: dict | None = None, stream: bool = True) -> dict:
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body


def usage(lasts: list[RequestOutput], n: int) -> dict:
    """Each prompt once (its n completions share it) and every completion's tokens."""
    prompt = sum(out.num_prompt_tokens for out in lasts[::n])
    return usage_body(prompt, sum(out.num_output_tokens for out in lasts))


def usage_body(prompt: int, completion: int) -> dict:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
