"""Checks of a request that pydantic's types cannot say: unsupported fields, fields that need
(or refuse) streaming, the context length; and the fields nothing reads, for the log."""
from pydantic import BaseModel

from nanovllm.engine.request_checks import check_truncation

# Fields that would change the output but are not supported, with the values that change
# nothing: any other value is a 400 naming the field.
REFUSED = {"suffix": (None, ""), "best_of": (None, 1), "use_beam_search": (False,),
           "length_penalty": (1.0,), "spaces_between_special_tokens": (True,),
           "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
           "priority": (0,), "cache_salt": (None,),
           "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
           "guided_grammar": (None,), "chat_template": (None,)}
# what to send instead, where the server has it
INSTEAD = {**{f"guided_{kind}": f"structured_outputs={{{kind!r}: ...}}"
              for kind in ("json", "regex", "choice", "grammar")},
           "chat_template": "chat_template_kwargs for the served template's variables"}


class FieldError(ValueError):
    """A ValueError about one field of the request, answered as a 400 naming it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def unknown_fields(value: object, path: str = "") -> list[str]:
    """The keys nothing reads in `value` (a model with extra="allow") and the models inside it,
    as dotted paths ("messages.0.x")."""
    if isinstance(value, BaseModel):
        found = [path + name for name in value.model_extra or ()]
        for name in type(value).model_fields:
            found += unknown_fields(getattr(value, name), f"{path}{name}.")
        return found
    if isinstance(value, list):
        return [key for i, item in enumerate(value) for key in unknown_fields(item, f"{path}{i}.")]
    return []


def check_range(name: str, value: int, low: int, high: int) -> None:
    """FieldError unless low <= value <= high."""
    if not low <= value <= high:
        raise FieldError(name, f"{name}={value!r} is not supported: expected an int in "
                               f"[{low}, {high}]")


def refuse_unsupported(body: BaseModel) -> None:
    """A FieldError for the first field of REFUSED set to anything but its neutral value."""
    for name, neutral in REFUSED.items():
        value = getattr(body, name, neutral[0])
        if value not in neutral:
            hint = f": use {INSTEAD[name]}" if name in INSTEAD else ""
            raise FieldError(name, f"{name}={value!r} is not supported by this server{hint}")


def check_streaming(body: BaseModel) -> None:
    """stream_options needs stream=true (OpenAI, vLLM); prompt_logprobs refuses it (vLLM), and
    so does echo with logprobs (the prompt's logprobs come only with the last output)."""
    stream = body.stream
    if body.stream_options is not None and not stream:
        raise FieldError("stream_options", "stream_options is only allowed with stream=true")
    if stream and body.prompt_logprobs is not None:
        raise FieldError("prompt_logprobs", "prompt_logprobs is not available with stream=true")
    if stream and getattr(body, "echo", False) and getattr(body, "logprobs", None) is not None:
        raise FieldError("echo", "echo=true with logprobs is supported without stream only")


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_tokens_field: str,
                  max_model_len: int, prompt_field: str) -> None:
    """vLLM's 400 for a prompt, or a prompt and max_tokens, longer than the context."""
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise FieldError(prompt_field, (
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has {num_prompt_tokens} input tokens, leaving no room for "
                f"the completion. Please reduce the length of the {prompt_field}."))
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise FieldError(max_tokens_field, (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"messages, {max_tokens} in the completion). Please reduce the length of the "
            f"messages or completion."))


def check_fields(body: BaseModel, max_model_len: int) -> None:
    """What can be refused before any work on the prompt: the unsupported fields' values and
    truncate_prompt_tokens' range."""
    refuse_unsupported(body)
    try:
        check_truncation(body.truncate_prompt_tokens, max_model_len)
    except ValueError as e:
        raise FieldError("truncate_prompt_tokens", str(e)) from None
