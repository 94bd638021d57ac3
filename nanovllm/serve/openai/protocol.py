"""OpenAI's request bodies (with vLLM's extra sampling fields) and their SamplingParams."""
from typing import Literal

from pydantic import BaseModel, model_validator

from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.serve.openai.structured import requested_structure, response_format_unknown
from nanovllm.serve.openai.tool_calls import (
    STRICT,
    Tool,
    ToolChoice,
    resolve_tool_choice,
    template_tool,
    tool_schema,
)
from nanovllm.serve.openai.validation import (
    FieldError,
    check_range,
    check_streaming,
    unknown_fields,
)

MAX_N = 128  # completions per request: each is a sequence in the batch
MAX_LOGPROBS = 20  # OpenAI's cap on logprobs (completions) and top_logprobs (chat)
MAX_PROMPTS = 1024  # prompts in one completions request


def _null_is_default(data: object, fields: dict) -> object:
    """A body without its declared fields set to null: OpenAI's nullable fields (n, stream,
    echo, ...) then take their defaults, as vLLM takes them."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None or k not in fields}
    return data


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions; unknown fields are ignored
    (and logged: ignored_fields)."""

    model_config = STRICT

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
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings
    allowed_token_ids: list[int] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # per prompt token: its own and the top k's
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    # vLLM's, refused unless neutral (validation.REFUSED)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    priority: int = 0
    cache_salt: str | None = None
    guided_json: str | dict | None = None  # vLLM's older structured outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's and vLLM's ways to constrain the output (structured.py): at most one
    response_format: dict | None = None
    structured_outputs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: object) -> object:
        return _null_is_default(data, cls.model_fields)

    def sampling_params(self, default_max_tokens: int, defaults: dict | None = None
                        ) -> SamplingParams:
        """The SamplingParams asked for, `defaults` (the model's generation_config.json) for
        the fields left unset; ValueError names a bad or unsupported field."""
        check_streaming(self)  # refuse_unsupported ran first (validation.check_fields)
        check_range("n", self.n, 1, MAX_N)
        limit = self.requested_max_tokens
        if limit is not None and limit < 1:  # named as sent: max_completion_tokens on chat
            raise FieldError(self.max_tokens_field, f"{self.max_tokens_field}={limit} is "
                                                    f"invalid: expected an int >= 1")
        if self.prompt_logprobs is not None:
            check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        fields = dict(max_tokens=self.requested_max_tokens, temperature=self.temperature,
                      top_p=self.top_p, prompt_logprobs=self.prompt_logprobs,
                      top_k=self.top_k, min_p=self.min_p, stop=self.stop, seed=self.seed,
                      stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                      skip_special_tokens=self.skip_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty,
                      repetition_penalty=self.repetition_penalty, n=self.n,
                      logprobs=self.num_logprobs(), logit_bias=self.token_logit_bias(),
                      allowed_token_ids=self.allowed_token_ids, min_tokens=self.min_tokens,
                      bad_words=self.bad_words, structured_outputs=self.structure()[0])
        fields = {**(defaults or {}), **{k: v for k, v in fields.items() if v is not None}}
        fields.setdefault("max_tokens", default_max_tokens)
        return SamplingParams(**fields)

    def structure(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the structured outputs asked for, the field that asked), or (None, None)."""
        return requested_structure(self.response_format, self.structured_outputs)

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
    def requested_max_tokens(self) -> int | None:
        """The completion's length limit the request set, None for the default."""
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field that holds requested_max_tokens, for errors."""
        return "max_tokens"

    @property
    def ignored_fields(self) -> list[str]:
        """The body's fields that nothing reads, nested ones as paths ("messages.0.x")."""
        return sorted(unknown_fields(self) + response_format_unknown(self.response_format))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: continuous_usage_stats with include_usage (vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: the top logprobs asked per token, None for no logprobs."""
        raise NotImplementedError


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None  # the top logprobs per token, plus the sampled token's
    suffix: str | None = None  # refused unless None (validation.REFUSED)
    best_of: int | None = None  # refused unless None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like (as offline)

    def num_logprobs(self) -> int | None:
        if self.logprobs is not None:
            check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        return self.logprobs

    def sampling_params(self, default_max_tokens: int, defaults: dict | None = None
                        ) -> SamplingParams:
        """As for any request; with echo, logprobs cover the prompt too (prompt_logprobs, as
        vLLM: an explicit prompt_logprobs wins)."""
        if self.best_of is not None and self.best_of < self.n:  # OpenAI's and vLLM's 400
            raise FieldError("best_of", f"best_of={self.best_of} must be >= n={self.n}")
        params = super().sampling_params(default_max_tokens, defaults)
        if self.echo and params.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = params.logprobs
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids: `prompt` may be one or a list of them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > MAX_PROMPTS:
                raise FieldError("prompt", f"prompt holds {len(prompt)} prompts: at most "
                                           f"{MAX_PROMPTS} per request")
            return prompt
        return [prompt]


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: str
    content: str | list[TextPart] | None = None
    # what chat templates read of tool conversations: an assistant's calls, a result's call
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict:
        """{"role", "content"} with text parts joined by newlines (vLLM), and the tool fields
        set, as a chat template reads them."""
        content = self.content or ""
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        tool_fields = self.model_dump(include={"name", "tool_calls", "tool_call_id"},
                                      exclude_none=True)
        return {"role": self.role, "content": content, **tool_fields}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False  # the sampled tokens' logprobs
    top_logprobs: int | None = None  # and the top k's, with logprobs=true
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # "auto" with tools, "none" without (tool_calls.py)
    parallel_tool_calls: bool = True  # false: at most one call (vLLM keeps the first)
    # vLLM's: the chat template's generation prompt and its own keyword arguments
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open
    documents: list[dict] | None = None  # for templates that take them (RAG)
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = False  # the template writes them (vLLM's default for chat)
    chat_template: str | None = None  # a request's own template: refused unless None
    echo: bool = False  # vLLM's chat echo: refused unless false

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else the older max_tokens (vLLM's order)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "max_tokens"

    def sampling_params(self, default_max_tokens: int, defaults: dict | None = None
                        ) -> SamplingParams:
        """As for any request; a tool choice other than "none" is not streamed."""
        if self.echo:
            raise FieldError("echo", "echo=true is not supported for chat completions")
        if self.stream and self.effective_tool_choice() != "none":
            raise FieldError("tools", "tools with a tool_choice other than \"none\" are "
                                      "supported without stream only")
        return super().sampling_params(default_max_tokens, defaults)

    def effective_tool_choice(self) -> ToolChoice:
        """tool_choice, or its default."""
        return resolve_tool_choice(self.tools, self.tool_choice)

    def structure(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """A forced tool call's JSON (field tool_choice), else as for any request."""
        schema = tool_schema(self.tools, self.effective_tool_choice(), self.parallel_tool_calls)
        if schema is None:
            return super().structure()
        if super().structure()[0] is not None:
            raise FieldError("tool_choice", "a forced tool call cannot be combined with "
                                            "response_format or structured_outputs")
        return StructuredOutputsParams(json=schema), "tool_choice"

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them (vLLM passes them even for "none")."""
        return None if not self.tools else [template_tool(t) for t in self.tools]

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise FieldError("top_logprobs",
                                 f"top_logprobs={self.top_logprobs} needs logprobs=true")
            check_range("top_logprobs", self.top_logprobs, 0, MAX_LOGPROBS)
        return (self.top_logprobs or 0) if self.logprobs else None
