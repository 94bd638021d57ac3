"""Attention over the paged KV cache: q/k norm, RoPE, the K/V write, then the backend's kernels."""
import torch
from torch import nn

from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """RoPE (after a per-head RMSNorm of q and k when qk_norm_eps is given), this step's K/V
    into the paged cache, then causal attention (within sliding_window keys, if set).

    q/k/v are [N, heads, D] before RoPE. The backend (layers.backends) is set by the ModelRunner
    with the KV cache; it decides whether the norm, RoPE and K/V write run as one kernel.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 rotary_emb: RotaryEmbedding, qk_norm_eps: float | None = None,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.rotary_emb = rotary_emb
        norm = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, eps=qk_norm_eps) if norm else None
        self.k_norm = RMSNorm(head_dim, eps=qk_norm_eps) if norm else None
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = None

    def kv_store_args(self, v: torch.Tensor) -> tuple | None:
        """(v, k_cache, v_cache, slot_mapping) when this step writes the cache, else None."""
        slot_mapping = get_context().slot_mapping
        if self.k_cache.numel() and slot_mapping is not None:
            return v, self.k_cache, self.v_cache, slot_mapping
        return None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        ctx, backend = get_context(), self.backend
        q, k = backend.rope_and_store(self, positions, q, k, v)
        if ctx.is_prefill:
            return backend.prefill(q, k, v, self.k_cache, self.v_cache, ctx, self.scale,
                                   self.sliding_window)
        return backend.decode(q, self.k_cache, self.v_cache, ctx, self.scale,
                              self.sliding_window)
