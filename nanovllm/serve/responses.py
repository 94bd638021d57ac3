"""OpenAI's response bodies: whole (completion, chat.completion) or as server-sent events."""
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from uuid import uuid4

from nanovllm.engine.async_llm import RequestOutput


def sse(payload: dict | str) -> str:
    """One server-sent event's data line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ResponseFormat:
    """Builds one request's response objects, for /v1/completions or /v1/chat/completions."""

    def __init__(self, model_name: str, chat: bool):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid4().hex}"
        self.model = model_name
        self.created = int(time.time())

    def full(self, text: str, last: RequestOutput) -> dict:
        """The whole answer at once."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": last.finish_reason}
        return self._body([choice], usage=usage(last), stream=False)

    def chunk(self, text: str, finish_reason: str | None = None, role: bool = False) -> dict:
        """One streamed piece; a chat stream's first chunk carries the role."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._body([choice])

    async def sse(self, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                  include_usage: bool) -> AsyncIterator[str]:
        """The stream: a chunk per output (its text may be empty while a character or a
        possible stop string is held back, as in vLLM), then `data: [DONE]`. Closing it (the
        client left) closes `outputs`, which aborts the request."""
        last = first
        if self.chat:
            yield sse(self.chunk("", role=True))
        async with aclosing(outputs):
            try:
                yield sse(self.chunk(first.new_text, first.finish_reason))
                async for last in outputs:
                    yield sse(self.chunk(last.new_text, last.finish_reason))
            except RuntimeError as e:  # the engine failed this request; the server goes on
                yield sse({"error": {"message": str(e), "type": "internal_error",
                                     "param": None, "code": 500}})
        if include_usage:
            yield sse(self._body([], usage=usage(last)))
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


def usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}
