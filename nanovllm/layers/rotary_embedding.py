"""Rotary position embedding (neox style: rotate halves), cos/sin cached in float32."""
import torch
from torch import nn


def rope_theta(hf_config) -> float:
    """rope_theta from either config format (transformers 5 `rope_parameters` or older)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None)
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", rope_type))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported (only 'default')")
    return float(theta if theta is not None else 10000.0)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos/sin [N, 1, D/2] in float32."""
    x1, x2 = torch.chunk(x.float(), 2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at the given positions (the CPU path; on CUDA the model uses the
    fused q/k kernel, which reads cos_sin_cache)."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)  # (max_position, D/2)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1)  # (P, 1, D)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)
