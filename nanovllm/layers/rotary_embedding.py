"""Rotary position embedding (neox style: rotate halves), cos/sin cached in float32.

The RoPE variants (default, linear, llama3, yarn) differ only in how the cache is built, with
the formulas of transformers' modeling_rope_utils; the fused q/k kernel reads the same cache.
"""
import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys each type reads; any other key (apart from the bookkeeping ones) changes nothing we know
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}
_BOOKKEEPING = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def rope_parameters(config: dict, default_theta: float = 10000.0) -> dict:
    """One flat dict {rope_type, rope_theta, ...} from either config.json format, checked."""
    params = dict(config.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters {sorted(params)} are not supported")
    params.update(config.get("rope_scaling") or {})
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    theta = params.get("rope_theta") or config.get("rope_theta") or default_theta
    params["rope_theta"] = float(theta)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    unknown = set(params) - _BOOKKEEPING - _ROPE_KEYS[rope_type]
    if unknown:
        raise ValueError(f"rope type {rope_type!r}: unsupported parameter(s) {sorted(unknown)}")
    if rope_type in ("llama3", "yarn"):
        # as transformers' standardize_rope_params
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings")
                          or config["max_position_embeddings"])
    needed = _ROPE_KEYS[rope_type] & {"factor", "low_freq_factor", "high_freq_factor"}
    missing = sorted(k for k in needed if params.get(k) is None and rope_type != "yarn")
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {missing}")
    return params


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def _llama3_inv_freq(params: dict, dim: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor, old_len = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(params: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale cos/sin by mscale."""
    theta, old_len = params["rope_theta"], params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all \
            else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    kept = 1 - ramp  # the share of each frequency left unscaled (rounded as in transformers)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
    return inv_freq, float(attention_factor)


def inv_freq_and_scale(params: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], factor applied to cos and sin) for a rope_parameters dict."""
    rope_type = params["rope_type"]
    if rope_type == "llama3":
        return _llama3_inv_freq(params, dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, dim, max_position)
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    return (inv_freq / params["factor"] if rope_type == "linear" else inv_freq), 1.0


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos/sin [N, 1, D/2] in float32."""
    x1, x2 = torch.chunk(x.float(), 2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at the given positions; cos_sin_cache [P, 1, D] = cat(cos, sin)."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq, scale = inv_freq_and_scale(params, head_dim, max_position)
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)  # (max_position, D/2)
        cache = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).unsqueeze(1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)
