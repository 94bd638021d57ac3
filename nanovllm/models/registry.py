"""Architecture name -> model class, and what that family's config.json means as its flags.

Defaults are those of the family's transformers config class, so a config.json that leaves a
field out means what it means to transformers; a field that changes the math and that we do not
implement is an error, never ignored.
"""
from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.quantization import QuantConfig
from nanovllm.models.decoder import DecoderForCausalLM, DecoderSpec, MoeSpec

_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False)
_QWEN_WINDOW = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)


def _qwen_windows(cfg: PretrainedConfig) -> tuple[int | None, ...]:
    """Qwen2Config/Qwen3Config: a window only with use_sliding_window, on the layers that
    layer_types marks, by default layers max_window_layers and up."""
    window = cfg.sliding_window if cfg.use_sliding_window else None
    layer_types = getattr(cfg, "layer_types", None) or [
        "sliding_attention" if window is not None and i >= cfg.max_window_layers
        else "full_attention" for i in range(cfg.num_hidden_layers)]
    allowed = {"sliding_attention", "full_attention"}
    if len(layer_types) != cfg.num_hidden_layers or not set(layer_types) <= allowed:
        raise ValueError(f"layer_types={layer_types} must hold num_hidden_layers="
                         f"{cfg.num_hidden_layers} entries from {sorted(allowed)}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _qwen3(cfg: PretrainedConfig) -> dict:
    return dict(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, mlp_bias=False,
                qk_norm=True, sliding_windows=_qwen_windows(cfg))


def num_experts(cfg: PretrainedConfig) -> int:
    """`num_experts` (the released checkpoints) or `num_local_experts` (what transformers 5
    writes); Qwen3MoeConfig's default 128 when neither is given."""
    named = {k: getattr(cfg, k) for k in ("num_experts", "num_local_experts")
             if getattr(cfg, k, None) is not None}
    if len(set(named.values())) > 1:
        raise ValueError(f"config.json's expert counts disagree: {named}")
    return next(iter(named.values()), 128)


def _moe_spec(cfg: PretrainedConfig) -> MoeSpec:
    """Qwen3MoeDecoderLayer's rule: sparse unless in mlp_only_layers or off decoder_sparse_step."""
    experts, top_k, step = num_experts(cfg), cfg.num_experts_per_tok, cfg.decoder_sparse_step
    mlp_only = cfg.mlp_only_layers or []
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step={step!r} must be an int >= 1")
    if any(not isinstance(i, int) or not 0 <= i < cfg.num_hidden_layers for i in mlp_only):
        raise ValueError(f"mlp_only_layers={mlp_only} must hold layer indices in "
                         f"[0, {cfg.num_hidden_layers})")
    sparse = tuple(i not in mlp_only and (i + 1) % step == 0
                   for i in range(cfg.num_hidden_layers))
    return MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=cfg.moe_intermediate_size,
                   norm_topk_prob=bool(cfg.norm_topk_prob), sparse_layers=sparse)


def _qwen3_moe(cfg: PretrainedConfig) -> dict:
    # Qwen3MoeConfig has no layer_types: a window, when used, applies to every layer
    window = cfg.sliding_window if cfg.use_sliding_window else None
    return dict(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, mlp_bias=False,
                qk_norm=True, sliding_windows=(window,) * cfg.num_hidden_layers,
                moe=_moe_spec(cfg))


def _qwen2(cfg: PretrainedConfig) -> dict:
    return dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False,
                sliding_windows=_qwen_windows(cfg))


def _llama(cfg: PretrainedConfig) -> dict:
    return dict(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias,
                qk_norm=False, sliding_windows=(None,) * cfg.num_hidden_layers)


def _mistral(cfg: PretrainedConfig) -> dict:
    # MistralModel applies config.sliding_window to every layer (layer_types is not read)
    return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                sliding_windows=(cfg.sliding_window,) * cfg.num_hidden_layers)


@dataclass(frozen=True)
class Family:
    """One architecture: its config class's defaults and how its fields map to the flags."""

    defaults: dict
    flags: Callable[[PretrainedConfig], dict]
    model_class: type[nn.Module] = DecoderForCausalLM


# num_key_value_heads None means one KV head per attention head in every family.
ARCHITECTURES: dict[str, Family] = {
    "Qwen3ForCausalLM": Family(dict(_COMMON, **_QWEN_WINDOW, head_dim=128, attention_bias=False,
                                    max_position_embeddings=32768, num_key_value_heads=32),
                               _qwen3),
    "Qwen3MoeForCausalLM": Family(dict(_COMMON, use_sliding_window=False, sliding_window=4096,
                                       attention_bias=False, max_position_embeddings=32768,
                                       num_key_value_heads=4, decoder_sparse_step=1,
                                       moe_intermediate_size=768, num_experts_per_tok=8,
                                       norm_topk_prob=False, mlp_only_layers=[]), _qwen3_moe),
    "Qwen2ForCausalLM": Family(dict(_COMMON, **_QWEN_WINDOW, max_position_embeddings=32768,
                                    num_key_value_heads=32), _qwen2),
    "LlamaForCausalLM": Family(dict(_COMMON, attention_bias=False, mlp_bias=False,
                                    max_position_embeddings=2048, num_key_value_heads=None),
                               _llama),
    "MistralForCausalLM": Family(dict(_COMMON, sliding_window=4096, num_key_value_heads=8,
                                      max_position_embeddings=4096 * 32), _mistral),
}


def architecture(config: dict, model: str) -> str:
    """The supported architecture config.json names, or a ValueError listing the supported."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {archs} in {model!r}; "
                     f"supported: {list(ARCHITECTURES)}")


def with_family_defaults(config: dict, arch: str) -> dict:
    """config.json's fields over the family's defaults, with transformers' derived values."""
    config = {**ARCHITECTURES[arch].defaults, **config}
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def decoder_spec(cfg: PretrainedConfig) -> DecoderSpec:
    """The decoder flags of a config read by config.read_config_json; raises on what we lack."""
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
    arch = next(a for a in cfg.architectures if a in ARCHITECTURES)
    flags = ARCHITECTURES[arch].flags(cfg)
    for window in flags["sliding_windows"]:
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window={window!r} must be None or an int >= 1")
    return DecoderSpec(head_dim=cfg.head_dim, rope=cfg.rope_parameters, **flags)


def build_model(cfg: PretrainedConfig, quant: QuantConfig | None = None) -> nn.Module:
    """The model for a config read by config.read_config_json (parameters uninitialised), its
    linear layers in the weight format `quant` describes."""
    arch = next(a for a in cfg.architectures if a in ARCHITECTURES)
    return ARCHITECTURES[arch].model_class(cfg, replace(decoder_spec(cfg), quant=quant))
