"""Load a checkpoint's tokenizer as AutoTokenizer would, without importing what it imports."""
import json
import os

import transformers
from transformers import PreTrainedTokenizerBase


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with an error that names the directory."""
    try:
        return tokenizer_class(model).from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model!r}: {e}") from e


def tokenizer_class(model: str) -> type:
    """The class tokenizer_config.json names (what AutoTokenizer resolves), else AutoTokenizer.

    AutoTokenizer's module imports transformers' modeling and generation stack (and sklearn,
    accelerate, sympy where installed): 7 of the 12 s `import nanovllm` took on the H200.
    The class alone costs ~0.1 s.
    """
    try:
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
        cls = getattr(transformers, name)
        if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
            return cls
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # no such file or field, or a class this transformers lacks: let AutoTokenizer say
    from transformers import AutoTokenizer
    return AutoTokenizer
