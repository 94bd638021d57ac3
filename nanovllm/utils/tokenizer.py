"""Load a checkpoint's tokenizer as AutoTokenizer would, without importing what it imports."""
import json
import os

import transformers
from transformers import PreTrainedTokenizerBase

from nanovllm.utils.field_checks import check
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


# apply_chat_template's own arguments, which change what it returns: chat_template_kwargs
# holds the template's variables (enable_thinking, documents, ...), never these.
TEMPLATE_CALL_ARGS = ("conversation", "tokenize", "return_dict", "return_tensors", "padding",
                      "truncation", "max_length", "return_assistant_tokens_mask",
                      "tokenizer_kwargs")


def chat_template_options(add_generation_prompt: bool = True,
                          continue_final_message: bool = False,
                          chat_template: str | None = None, tools: list[dict] | None = None,
                          chat_template_kwargs: dict | None = None) -> dict:
    """apply_chat_template's keyword arguments as vLLM's LLM.chat builds them (the options,
    then chat_template_kwargs over them); ValueError names a bad one."""
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        check(name, value, isinstance(value, bool), "a bool")
    check("chat_template", chat_template, chat_template is None or isinstance(chat_template, str),
          "None or a Jinja template string")
    check("tools", tools, tools is None or (isinstance(tools, list) and all(
        isinstance(tool, dict) for tool in tools)), "None or a list of dicts")
    extra = {} if chat_template_kwargs is None else chat_template_kwargs
    check("chat_template_kwargs", chat_template_kwargs, isinstance(extra, dict) and all(
        isinstance(key, str) for key in extra), "None or a dict with str keys")
    refused = next((key for key in TEMPLATE_CALL_ARGS if key in extra), None)
    if refused is not None:
        raise ValueError(f"chat_template_kwargs may not set {refused!r}: it is an argument of "
                         f"the call, not a template variable")
    options = {"add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message,
               "chat_template": chat_template, "tools": tools, **extra}
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise ValueError("Cannot set both continue_final_message and add_generation_prompt to "
                         "true (vLLM's rule): pass add_generation_prompt=False")
    return options


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]],
                    options: dict) -> list[list[int]]:
    """Each conversation through the chat template (options: chat_template_options), as token
    ids ready to generate."""
    if (options["chat_template"] or tokenizer.chat_template) is None:
        raise ValueError(f"the tokenizer of {tokenizer.name_or_path!r} has no chat template: "
                         f"pass chat_template")
    found = []
    for i, conversation in enumerate(conversations):
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, **options)
        except Exception as e:  # a template may raise anything (jinja2's errors, its own)
            raise ValueError(f"conversation {i}: the chat template failed: {e}") from None
        # The template's text already holds any special tokens: encode it without adding more.
        found.append(tokenizer.encode(text, add_special_tokens=False))
    return found
