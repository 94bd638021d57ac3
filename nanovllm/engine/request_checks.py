"""Request validation: every request of a call is checked before any of them is queued."""
from collections.abc import Callable
from copy import copy
from dataclasses import dataclass

from nanovllm.engine.structured_outputs import StructuredOutputs
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.field_checks import describe, is_int

# A string, int token ids, or vLLM's TextPrompt / TokensPrompt dict of either
Prompt = str | list[int] | dict
PROMPT_KEYS = ("prompt", "prompt_token_ids")
PROMPT_FORMS = "a str, a list of int token ids, or a {'prompt': str} or {'prompt_token_ids': " \
               "list} dict"
Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class RequestLimits:
    """What the engine can serve: the vocabulary, the context length and the KV pool."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    eos_token_ids: tuple[int, ...] = ()  # min_tokens holds them back with stop_token_ids


def max_blocks_needed(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                      block_size: int) -> int:
    """KV blocks a request holds at its peak (the last sampled token's K/V is never stored)."""
    final_len = min(num_prompt_tokens + max_tokens, max_model_len)
    return -(-(final_len - 1) // block_size)


def check_sampling_params(params: SamplingParams) -> None:
    """Re-check every field: they may have been mutated since construction."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {describe(params)}")
    params.validate()


def resolve_steering(params: SamplingParams, limits: RequestLimits,
                     encode: Callable[..., list[int]]) -> SamplingParams:
    """Check the steering fields' ids and the logprobs asked against the vocabulary; return a
    copy of params holding bad_words' and min_tokens' token ids (tokenized here, once per
    request, never per step)."""
    vocab = limits.vocab_size
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids or ())):
        bad = next((i for i in ids if i >= vocab), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside [0, {vocab}) (the model's "
                             f"vocab_size)")
    for name in ("logprobs", "prompt_logprobs"):  # more than there are: refused, not capped
        k = getattr(params, name)
        if k is not None and k > vocab:
            raise ValueError(f"{name}={k} is invalid: expected at most the model's vocab_size "
                             f"{vocab}")
    # A copy, as vLLM takes one: the caller may change and reuse its object for the next
    # request (or another engine, another tokenizer) while this one is queued.
    params = copy(params)
    if params.bad_words:
        params._bad_words_token_ids = bad_words_token_ids(params.bad_words, encode, vocab)
    if params.min_tokens:
        params._min_tokens_stop_ids = sorted({*(params.stop_token_ids or ()),
                                              *limits.eos_token_ids})
    return params


def bad_words_token_ids(words: list[str], encode: Callable[..., list[int]],
                        vocab_size: int) -> list[list[int]]:
    """vLLM's: each word's ids, and those of " " + word when that is a new, as long sequence
    (so a word is banned at the start of the text and after a space)."""
    found: list[list[int]] = []
    for word in words:
        plain = list(encode(word.lstrip(), add_special_tokens=False))
        spaced = list(encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words: {word!r} encodes to no tokens")
        found.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(spaced)
    bad = next((i for ids in found for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"bad_words: token id {bad} is outside [0, {vocab_size}) (the model's "
                         f"vocab_size)")
    return found


def as_prompt_list(prompts: object) -> list:
    """One prompt (a string, int token ids or a prompt dict) or a list of prompts, as a list
    of prompts."""
    # Arrays and tensors are refused here: their truth value is ambiguous.
    if isinstance(prompts, str | dict) or (isinstance(prompts, list | tuple) and prompts
                                           and is_int(prompts[0])):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise ValueError(f"prompts must be a prompt ({PROMPT_FORMS}) or a list of prompts, got "
                         f"{describe(prompts)}{_tolist_hint(prompts)}")
    return list(prompts)


def prompt_token_ids(prompt: Prompt, encode: Callable[..., list[int]]) -> list[int]:
    """A string is tokenized; a list or tuple must hold ints only (numpy ints too); a dict
    holds one of them under vLLM's key ("prompt" or "prompt_token_ids") and nothing else."""
    if isinstance(prompt, dict):
        prompt = _unwrap_prompt_dict(prompt)
    if isinstance(prompt, str):
        return list(encode(prompt))
    if not isinstance(prompt, list | tuple):
        raise ValueError(f"prompt must be {PROMPT_FORMS}, got "
                         f"{describe(prompt)}{_tolist_hint(prompt)}")
    if all(type(token) is int for token in prompt):  # the common case, fast
        return list(prompt)
    for pos, token in enumerate(prompt):
        if not is_int(token):
            raise ValueError(f"prompt token at position {pos} is {describe(token)}; "
                             f"a prompt list must hold int token ids only")
    return [int(token) for token in prompt]


def _unwrap_prompt_dict(prompt: dict) -> object:
    """The text or ids of a TextPrompt / TokensPrompt; other keys (multi_modal_data,
    cache_salt, ...) are refused, not ignored."""
    keys = sorted(map(str, prompt))
    if len(keys) != 1 or keys[0] not in PROMPT_KEYS:
        hint = "; a conversation's messages go to chat()" if "role" in keys else ""
        raise ValueError(f"a prompt dict must hold exactly one of the keys {list(PROMPT_KEYS)}, "
                         f"got {keys}{hint}")
    [(key, value)] = prompt.items()
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"prompt dict: 'prompt' must be a str, got {describe(value)}")
    if key == "prompt_token_ids" and not isinstance(value, list | tuple):
        raise ValueError(f"prompt dict: 'prompt_token_ids' must be a list of int token ids, "
                         f"got {describe(value)}{_tolist_hint(value)}")
    return value


def check_truncation(keep: int | None, max_model_len: int) -> None:
    """truncate_prompt_tokens within what the engine serves: None, -1 or [1, max_model_len]."""
    if keep is not None and not (keep == -1 or 1 <= keep <= max_model_len):
        raise ValueError(f"truncate_prompt_tokens={keep} is invalid: expected -1 (max_model_len) "
                         f"or an int in [1, max_model_len={max_model_len}]")


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens, -1 for max_model_len."""
    check_truncation(keep, max_model_len)
    if keep is None:
        return ids
    return ids[-(max_model_len if keep == -1 else keep):]


def validate_request(prompt: Prompt, params: SamplingParams, limits: RequestLimits,
                     encode: Callable[..., list[int]],
                     grammars: StructuredOutputs | None = None
                     ) -> tuple[list[int], SamplingParams]:
    """(the prompt's token ids, the params to queue: see resolve_steering), or ValueError
    saying what is wrong; `grammars` (the engine's) compiles structured outputs, else the
    engine checks them when queueing."""
    check_sampling_params(params)
    if params.structured_outputs is not None and grammars is not None:
        grammars.compile(params.structured_outputs)  # cached for the matchers made at queueing
    params = resolve_steering(params, limits, encode)
    token_ids = truncate_prompt(prompt_token_ids(prompt, encode), params.truncate_prompt_tokens,
                                limits.max_model_len)
    n = len(token_ids)
    if n == 0:
        raise ValueError(f"prompt {describe(prompt)} is empty (no tokens)")
    if n >= limits.max_model_len:
        raise ValueError(f"prompt has {n} tokens; it must have fewer than "
                         f"max_model_len={limits.max_model_len} to leave room for output")
    if not 0 <= min(token_ids) <= max(token_ids) < limits.vocab_size:
        pos, token = next((p, t) for p, t in enumerate(token_ids)
                          if not 0 <= t < limits.vocab_size)
        raise ValueError(f"token id {token} at position {pos} is outside "
                         f"[0, {limits.vocab_size}) (the model's vocab_size)")
    asked = params.max_tokens
    if asked is None:  # vLLM's: up to max_model_len (params is validation's own copy)
        params.max_tokens = limits.max_model_len - n
    need = max_blocks_needed(n, params.max_tokens, limits.max_model_len, limits.block_size)
    if need > limits.num_blocks:
        # Rejected now: the scheduler could never admit it, however long it waited.
        raise ValueError(
            f"prompt of {n} tokens with max_tokens={asked} (capped at "
            f"max_model_len={limits.max_model_len}) needs {need} KV blocks of "
            f"{limits.block_size} tokens, but the KV pool has only {limits.num_blocks}; "
            f"shorten the prompt, lower max_tokens, or give the pool more memory")
    return token_ids, params


def validate_requests(prompts: list[Prompt],
                      sampling_params: SamplingParams | list[SamplingParams] | None,
                      limits: RequestLimits, encode: Callable[..., list[int]],
                      grammars: StructuredOutputs | None = None,
                      default: Callable[[], SamplingParams] = SamplingParams
                      ) -> list[tuple[list[int], SamplingParams]]:
    """Validate a whole call up front; the error names the first bad request's index.
    Without sampling_params, default() (Config.default_sampling_params)."""
    prompts = as_prompt_list(prompts)
    if sampling_params is None:
        sampling_params = default()
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
            requests.append(validate_request(prompt, params, limits, encode, grammars))
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
    return requests


def as_conversation_list(messages: object) -> list[Conversation]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them, as a list."""
    if not isinstance(messages, list | tuple):
        raise ValueError(f"messages must be a conversation (a list of {{'role', 'content'}} "
                         f"dicts) or a list of conversations, got {describe(messages)}")
    if messages and isinstance(messages[0], dict):
        messages = [messages]
    for i, conversation in enumerate(messages):
        if not isinstance(conversation, list | tuple) or not conversation:
            raise ValueError(f"conversation {i} must be a non-empty list of {{'role', "
                             f"'content'}} dicts, got {describe(conversation)}")
        for j, message in enumerate(conversation):
            problem = _message_problem(message)
            if problem:
                raise ValueError(f"conversation {i}, message {j}: {problem}")
    return [list(conversation) for conversation in messages]


def _message_problem(message: object) -> str | None:
    if not isinstance(message, dict):
        return f"expected a {{'role': str, 'content': str}} dict, got {describe(message)}"
    if set(message) != {"role", "content"}:
        return f"expected exactly the keys 'role' and 'content', got {sorted(map(str, message))}"
    for key in ("role", "content"):
        if not isinstance(message[key], str):
            return f"{key} must be a str, got {describe(message[key])}"
    if not message["role"]:
        return "role must be a non-empty str"
    return None


def _tolist_hint(value: object) -> str:
    return "; pass a list of ints (e.g. .tolist())" if hasattr(value, "tolist") else ""
