"""load_tokenizer gives what AutoTokenizer gives, without importing transformers' model stack."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from nanovllm.utils.tokenizer import load_tokenizer, tokenizer_class

TEXTS = ["the quick brown fox", "  spaces\tand\nnewlines ", "<|im_start|>user hi<|im_end|>"]


def _with_class(src: str, dst: str, name: str | None) -> str:
    """Copy src's tokenizer files with tokenizer_config.json naming `name` (None: no field)."""
    os.makedirs(dst)
    for file in os.listdir(src):
        if file.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(src, file), dst)
    path = os.path.join(dst, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("tokenizer_class", None)
    if name is not None:
        config["tokenizer_class"] = name
    with open(path, "w") as f:
        json.dump(config, f)
    return dst


def _assert_same(ours, auto) -> None:
    assert type(ours) is type(auto)
    assert ours.eos_token_id == auto.eos_token_id and ours.all_special_ids == auto.all_special_ids
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
    chat = [{"role": "user", "content": TEXTS[0]}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("name", [None, "Qwen2Tokenizer", "Qwen2TokenizerFast",
                                  "PreTrainedTokenizerFast", "NoSuchTokenizer", "AutoConfig"])
def test_matches_auto_tokenizer(tiny_model, tmp_path, name) -> None:
    """Named classes (Qwen3's own among them) load directly; missing, unknown or non-tokenizer
    names fall back to AutoTokenizer itself, which then decides."""
    path = _with_class(tiny_model, str(tmp_path / "tok"), name)
    direct = name in ("Qwen2Tokenizer", "Qwen2TokenizerFast", "PreTrainedTokenizerFast")
    assert (tokenizer_class(path) is not None) == direct
    try:
        auto = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):  # AutoTokenizer's own error, in our message
        with pytest.raises(ValueError, match="cannot load a tokenizer from"):
            load_tokenizer(path)
        return
    _assert_same(load_tokenizer(path), auto)


def test_bad_directory_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot load a tokenizer from .*nothing"):
        load_tokenizer(str(tmp_path / "nothing"))


def test_llm_start_does_not_import_model_stack(tiny_model) -> None:
    """import nanovllm plus LLM() leave AutoTokenizer's heavy imports out (7 s on the H200)."""
    code = ("import sys; from nanovllm import LLM; llm = LLM(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.auto.auto_"
            "factory', 'transformers.generation.utils', 'transformers.modeling_utils'))))")
    out = subprocess.run([sys.executable, "-c", code, tiny_model], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_failing_named_class_falls_back_to_auto_tokenizer(tiny_model, monkeypatch) -> None:
    """A named class that cannot load the files (a slow class without its vocab files, say)
    leaves the choice to AutoTokenizer."""
    class Unloadable:
        @staticmethod
        def from_pretrained(path):
            raise OSError("no vocab.txt")

    monkeypatch.setattr("nanovllm.utils.tokenizer.tokenizer_class", lambda model: Unloadable)
    _assert_same(load_tokenizer(tiny_model), AutoTokenizer.from_pretrained(tiny_model))
