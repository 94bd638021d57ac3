"""Load a checkpoint's tokenizer as AutoTokenizer would, without importing what it imports."""
import json
import os

import transformers
from transformers import PreTrainedTokenizerBase

from nanovllm.utils.generation_config import read_generation_config

_ERRORS = (OSError, ValueError, ImportError, TypeError)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, hf_config: object, model: str
                  ) -> tuple[int, ...]:
    """The ids that end a completion, as vLLM stops on them: the tokenizer's EOS (else the
    config's), then those of generation_config.json (Llama-3's <|eot_id|>, Qwen3's
    <|endoftext|> beside <|im_end|>), each an int or a list."""
    found = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None
             else getattr(hf_config, "eos_token_id", None)]
    found.append((read_generation_config(model) or {}).get("eos_token_id"))
    ids: list[int] = []
    for entry in found:
        for i in entry if isinstance(entry, list) else [entry]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with an error that names the directory."""
    try:
        cls = tokenizer_class(model)
        if cls is not None:
            try:
                return cls.from_pretrained(model)
            except _ERRORS:
                pass  # AutoTokenizer may still find a way, or it says what is wrong
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model)
    except _ERRORS as e:
        raise ValueError(f"cannot load a tokenizer from {model!r}: {e}") from e


def tokenizer_class(model: str) -> type | None:
    """The class AutoTokenizer resolves from tokenizer_config.json (fast variant first), or None
    when AutoTokenizer must decide; the class alone imports in ~0.1 s, AutoTokenizer in seconds."""
    try:
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # no file, bad JSON, not an object
        return None
    if not isinstance(name, str):
        return None
    for candidate in (name,) if name.endswith("Fast") else (name + "Fast", name):
        cls = getattr(transformers, candidate, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
            return cls
    return None


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase,
                    conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """Each conversation through the tokenizer's chat template, as token ids ready to generate."""
    if tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer of {tokenizer.name_or_path!r} has no chat template")
    # The template's text already holds any special tokens: encode it without adding more.
    return [tokenizer.encode(
        tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False) for conv in conversations]
