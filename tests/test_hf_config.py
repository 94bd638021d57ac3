"""read_config_json gives AutoConfig's values for every field the model reads."""
import json
import os
import shutil

import pytest
from transformers import AutoConfig

from nanovllm.config import QWEN3_DEFAULTS, REQUIRED_FIELDS, read_config_json, resolve_dtype
from nanovllm.layers.rotary_embedding import rope_theta

FIELDS = (*REQUIRED_FIELDS, *QWEN3_DEFAULTS, "architectures", "eos_token_id")


def _write(src: str, dst: str, edit) -> str:
    """Copy src's config.json to dst after edit(dict)."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    edit(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _assert_as_auto(path: str) -> None:
    ours, auto = read_config_json(path), AutoConfig.from_pretrained(path)
    for name in FIELDS:
        assert getattr(ours, name) == getattr(auto, name), name
    assert rope_theta(ours) == rope_theta(auto)
    assert resolve_dtype("auto", "cuda", ours) == resolve_dtype("auto", "cuda", auto)


def test_matches_autoconfig(checkpoints) -> None:
    for path in checkpoints.values():
        _assert_as_auto(path)


def test_older_format(tiny_model, tmp_path) -> None:
    """rope_theta and torch_dtype (transformers 4 files) read as AutoConfig reads them."""
    def older(config):
        config["rope_theta"] = 123456.0
        config.pop("rope_parameters", None)
        config["torch_dtype"] = "bfloat16"
        config.pop("dtype", None)
    path = _write(tiny_model, str(tmp_path / "old"), older)
    _assert_as_auto(path)
    assert rope_theta(read_config_json(path)) == 123456.0


def test_defaults_are_qwen3_config_defaults(tiny_model, tmp_path) -> None:
    """Left out of config.json, each defaulted field gets Qwen3Config's default."""
    def strip(config):
        for name in QWEN3_DEFAULTS:
            config.pop(name, None)
    _assert_as_auto(_write(tiny_model, str(tmp_path / "bare"), strip))
    null_kv = _write(tiny_model, str(tmp_path / "mha"),
                     lambda config: config.update(num_key_value_heads=None))
    _assert_as_auto(null_kv)  # null: one KV head per attention head


@pytest.mark.parametrize("name", REQUIRED_FIELDS)
def test_missing_required_field_named(tiny_model, tmp_path, name) -> None:
    path = _write(tiny_model, str(tmp_path / name), lambda config: config.pop(name))
    with pytest.raises(ValueError, match=f"lacks \\['{name}'\\]"):
        read_config_json(path)


def test_unreadable_config_named(tiny_model, tmp_path) -> None:
    path = str(tmp_path / "bad")
    shutil.copytree(tiny_model, path)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="cannot read config.json of"):
        read_config_json(path)
