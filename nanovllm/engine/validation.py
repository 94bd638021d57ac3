"""Request validation: every request of a call is checked before any of them is queued."""
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass(frozen=True)
class RequestLimits:
    """What the engine can serve: the vocabulary, the context length and the KV pool."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int


def max_blocks_needed(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                      block_size: int) -> int:
    """KV blocks a request holds at its peak.

    It ends at min(prompt + max_tokens, max_model_len) tokens, and the last sampled token is
    never fed back, so K/V is stored for at most one token fewer than that.
    """
    final_len = min(num_prompt_tokens + max_tokens, max_model_len)
    return -(-(final_len - 1) // block_size)


def check_sampling_params(params: SamplingParams) -> None:
    """Re-check fields that may have been mutated since construction."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {_describe(params)}")
    max_tokens, temperature = params.max_tokens, params.temperature
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} is invalid: expected an int >= 1")
    real = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
    if not real or not temperature >= 0:  # `not >=` also rejects NaN
        raise ValueError(f"temperature={temperature!r} is invalid: expected a number >= 0 "
                         f"(0 = greedy)")
    params.__post_init__()  # every other field (top_p, seed, stop, ...) by the same rules


def prompt_token_ids(prompt: Prompt, encode: Callable[[str], list[int]]) -> list[int]:
    """A string is tokenized; a list must hold ints only."""
    if isinstance(prompt, str):
        return list(encode(prompt))
    if not isinstance(prompt, list | tuple):
        raise ValueError(f"prompt must be a str or a list of int token ids, "
                         f"got {_describe(prompt)}")
    if all(type(token) is int for token in prompt):  # the common case, fast
        return list(prompt)
    for pos, token in enumerate(prompt):
        if not _is_int(token):
            raise ValueError(f"prompt token at position {pos} is {_describe(token)}; "
                             f"a prompt list must hold int token ids only")
    return [int(token) for token in prompt]


def validate_request(prompt: Prompt, params: SamplingParams, limits: RequestLimits,
                     encode: Callable[[str], list[int]]) -> list[int]:
    """Return the prompt's token ids, or raise ValueError saying what is wrong."""
    check_sampling_params(params)
    token_ids = prompt_token_ids(prompt, encode)
    n = len(token_ids)
    if n == 0:
        raise ValueError(f"prompt {_describe(prompt)} is empty (no tokens)")
    if n >= limits.max_model_len:
        raise ValueError(f"prompt has {n} tokens; it must have fewer than "
                         f"max_model_len={limits.max_model_len} to leave room for output")
    if not 0 <= min(token_ids) <= max(token_ids) < limits.vocab_size:
        pos, token = next((p, t) for p, t in enumerate(token_ids)
                          if not 0 <= t < limits.vocab_size)
        raise ValueError(f"token id {token} at position {pos} is outside "
                         f"[0, {limits.vocab_size}) (the model's vocab_size)")
    need = max_blocks_needed(n, params.max_tokens, limits.max_model_len, limits.block_size)
    if need > limits.num_blocks:
        # Rejected now: the scheduler could never admit it, however long it waited.
        raise ValueError(
            f"prompt of {n} tokens with max_tokens={params.max_tokens} (capped at "
            f"max_model_len={limits.max_model_len}) needs {need} KV blocks of "
            f"{limits.block_size} tokens, but the KV pool has only {limits.num_blocks}; "
            f"shorten the prompt, lower max_tokens, or give the pool more memory")
    return token_ids


def validate_requests(prompts: list[Prompt],
                      sampling_params: SamplingParams | list[SamplingParams],
                      limits: RequestLimits,
                      encode: Callable[[str], list[int]]) -> list[tuple[list[int], SamplingParams]]:
    """Validate a whole call up front; the error names the first bad request's index."""
    if not isinstance(prompts, list | tuple):
        raise ValueError(f"prompts must be a prompt (a string or a list of token ids) or a list "
                         f"of prompts, got {_describe(prompts)}")
    if isinstance(sampling_params, list | tuple):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} "
                             f"prompts: pass one for all or exactly one per prompt")
        params_list = list(sampling_params)
    else:
        params_list = [sampling_params] * len(prompts)
    requests = []
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        try:
            requests.append((validate_request(prompt, params, limits, encode), params))
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
    return requests


def _is_int(value: object) -> bool:
    # numpy integers count; bools do not, though bool subclasses int.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _describe(value: object, width: int = 60) -> str:
    text = repr(value)
    if len(text) > width:
        text = text[:width - 3] + "..."
    return f"{text} ({type(value).__name__})"
