"""OpenAI's request bodies (with vLLM's extra sampling fields) and their SamplingParams."""
from typing import Literal

from pydantic import BaseModel, ConfigDict

from nanovllm.sampling_params import SamplingParams

MAX_N = 128  # completions per request: each is a sequence in the batch
MAX_LOGPROBS = 20  # OpenAI's cap on logprobs (completions) and top_logprobs (chat)
MAX_PROMPTS = 1024  # prompts in one completions request


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extras
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    allowed_token_ids: list[int] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The SamplingParams asked for; ValueError names a bad or unsupported field."""
        check_range("n", self.n, 1, MAX_N)
        fields = dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                      top_k=self.top_k, min_p=self.min_p, stop=self.stop, seed=self.seed,
                      stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                      skip_special_tokens=self.skip_special_tokens,
                      presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty,
                      repetition_penalty=self.repetition_penalty, n=self.n,
                      logprobs=self.num_logprobs(), logit_bias=self.token_logit_bias(),
                      allowed_token_ids=self.allowed_token_ids, min_tokens=self.min_tokens,
                      bad_words=self.bad_words)
        fields = {k: v for k, v in fields.items() if v is not None}
        fields.setdefault("max_tokens", default_max_tokens)
        return SamplingParams(**fields)

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with int keys; a key that is not a token id is a ValueError naming it."""
        if self.logit_bias is None:
            return None
        bad = next((k for k in self.logit_bias if not (k.isascii() and k.strip().isdigit())),
                   None)
        if bad is not None:
            raise ValueError(f"logit_bias: key {bad!r} is not a token id (a non-negative int)")
        return {int(k): v for k, v in self.logit_bias.items()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: the top logprobs asked per token, None for no logprobs."""
        raise NotImplementedError


def check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} is not supported: expected an int in "
                         f"[{low}, {high}]")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None  # the top logprobs per token, plus the sampled token's

    def num_logprobs(self) -> int | None:
        if self.logprobs is not None:
            check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        return self.logprobs

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """As for any request; with echo, logprobs cover the prompt too (prompt_logprobs)."""
        params = super().sampling_params(default_max_tokens)
        if self.echo and self.stream:
            raise ValueError("echo=True is supported without stream: expected false")
        if self.echo and params.logprobs is not None:
            params.prompt_logprobs = params.logprobs
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids: `prompt` may be one or a list of them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"prompt holds {len(prompt)} prompts: at most {MAX_PROMPTS} "
                                 f"per request")
            return prompt
        return [prompt]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        """{"role", "content"} with text parts joined, as a chat template reads it."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False  # the sampled tokens' logprobs
    top_logprobs: int | None = None  # and the top k's, with logprobs=true

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
            check_range("top_logprobs", self.top_logprobs, 0, MAX_LOGPROBS)
        return (self.top_logprobs or 0) if self.logprobs else None
