"""read_config_json gives transformers' values for every field the model reads, per family."""
import json
import os
import shutil

import pytest
from transformers import AutoConfig

from nanovllm.config import REQUIRED_FIELDS, read_config_json, resolve_dtype
from nanovllm.models.registry import ARCHITECTURES, decoder_spec

ROPE_KEYS = ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings")


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
    arch = auto.architectures[0]
    for name in (*REQUIRED_FIELDS, *ARCHITECTURES[arch].defaults, "architectures",
                 "eos_token_id"):
        if name == "sliding_window" and hasattr(auto, "use_sliding_window"):
            continue  # Qwen: None unless use_sliding_window; see test_qwen_window_rule
        if hasattr(auto, name):
            assert getattr(ours, name) == getattr(auto, name), name
    # the modeling files' head_dim: getattr(config, "head_dim", None) or hidden // heads
    head_dim = getattr(auto, "head_dim", None) or auto.hidden_size // auto.num_attention_heads
    assert decoder_spec(ours).head_dim == head_dim
    for key in ROPE_KEYS:
        assert ours.rope_parameters.get(key) == auto.rope_parameters.get(key), key
    assert resolve_dtype("auto", "cuda", ours) == resolve_dtype("auto", "cuda", auto)


def test_matches_autoconfig(checkpoints, family_checkpoints) -> None:
    for path in (*checkpoints.values(), *family_checkpoints.values()):
        _assert_as_auto(path)


def test_older_format(tiny_model, family_checkpoints, tmp_path) -> None:
    """rope_theta, rope_scaling and torch_dtype (transformers 4 files) read as AutoConfig."""
    def older(config):
        rope = config.pop("rope_parameters", None) or {}
        config["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        config["torch_dtype"] = "bfloat16"
        config.pop("dtype", None)
    path = _write(tiny_model, str(tmp_path / "old"),
                  lambda config: (older(config), config.update(rope_theta=123456.0)))
    _assert_as_auto(path)
    assert read_config_json(path).rope_parameters["rope_theta"] == 123456.0
    for name in ("llama3_bias_tied", "qwen2_yarn"):
        _assert_as_auto(_write(family_checkpoints[name], str(tmp_path / name), older))


def test_defaults_are_the_family_config_defaults(tiny_model, family_checkpoints,
                                                 tmp_path) -> None:
    """Left out of config.json, each defaulted field gets its family config class's default."""
    for i, path in enumerate((tiny_model, *family_checkpoints.values())):
        def strip(config):
            arch = config["architectures"][0]
            for name in ARCHITECTURES[arch].defaults:
                config.pop(name, None)
        _assert_as_auto(_write(path, str(tmp_path / f"bare{i}"), strip))
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


@pytest.mark.parametrize("edit, window_layers", [
    (dict(), (None, 64)),  # as built: use_sliding_window, sliding_window 64, max_window_layers 1
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=2), (None, None)),
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), (64, 64)),
    (dict(use_sliding_window=False, sliding_window=64, max_window_layers=0), (None, None)),
    (dict(use_sliding_window=True, sliding_window=32,
          layer_types=["sliding_attention", "full_attention"]), (32, None)),
])
def test_qwen_window_rule(family_checkpoints, tmp_path, edit, window_layers) -> None:
    """Qwen2's use_sliding_window / max_window_layers / layer_types as transformers reads them."""
    def apply(config):
        config.pop("layer_types", None)
        config.update(edit)
    path = _write(family_checkpoints["qwen2_window"], str(tmp_path / "w"), apply)
    auto = AutoConfig.from_pretrained(path)
    from_auto = tuple(auto.sliding_window if t == "sliding_attention" else None
                      for t in auto.layer_types)
    assert decoder_spec(read_config_json(path)).sliding_windows == window_layers == from_auto


@pytest.mark.parametrize("edit, message", [
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported \(only 'silu'\)"),
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
     r"rope type 'dynamic' is not supported; supported: \['default', 'linear', 'llama3', "
     r"'yarn'\]"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     r"partial_rotary_factor=0.5 is not supported"),
    (dict(rope_scaling=dict(type="linear", factor=2.0, beta_fast=4)),
     r"rope type 'linear': unsupported parameter\(s\) \['beta_fast'\]"),
    (dict(rope_scaling=dict(type="llama3", factor=2.0)),
     r"rope type 'llama3' needs \['high_freq_factor', 'low_freq_factor'\]"),
    (dict(layer_types=["full_attention"]), r"(?s)invalid config.json of .*layer_types"),
    (dict(layer_types=["full_attention", "chunked_attention"]),
     r"layer_types=\['full_attention', 'chunked_attention'\] must hold"),
    (dict(use_sliding_window=True, sliding_window=0), r"sliding_window=0 must be None or"),
])
def test_unsupported_fields_named(family_checkpoints, tmp_path, edit, message) -> None:
    path = _write(family_checkpoints["qwen2_window"], str(tmp_path / "x"),
                  lambda config: config.update(edit))
    with pytest.raises(ValueError, match=message):
        read_config_json(path)
