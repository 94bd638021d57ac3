"""Attention over the paged KV cache: q/k norm, RoPE, the K/V write, then the backend's kernels."""
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from nanovllm.kernels.attention.kv_quant import FP8_MAX
from nanovllm.kernels.attention.pending_merge import PendingMerge
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import get_context

logger = logging.getLogger(__name__)
# Calibrated FP8 scales leave this much headroom over the warm-up's amax: real prompts may run
# larger, and e4m3 keeps 3 mantissa bits across its normal range, so headroom costs only the
# smallest values (a factor 2 moves the subnormal edge up by one binade).
KV_SCALE_MARGIN = 2.0


class Attention(nn.Module):
    """RoPE (after a per-head RMSNorm of q and k when qk_norm_eps is given), this step's K/V
    into the paged cache, then causal attention through the bound backend (layers.backends)."""

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
        # An FP8 cache holds K / k_scale and V / v_scale (set by the ModelRunner; 1.0 otherwise)
        self.k_scale = self.v_scale = 1.0
        self.kv_amax: torch.Tensor | None = None  # [2] running max |K|, |V| while calibrating
        self.backend = None

    def kv_store_args(self, v: torch.Tensor) -> tuple | None:
        """(v, k_cache, v_cache, slot_mapping) when this step writes the cache, else None."""
        slot_mapping = get_context().slot_mapping
        if self.k_cache.numel() and slot_mapping is not None:
            return v, self.k_cache, self.v_cache, slot_mapping
        return None

    def takes_projection(self) -> bool:
        """Whether decode_projected can run: the cache allocated, no FP8 calibration."""
        return self.k_cache.numel() > 0 and self.kv_amax is None

    def decode_projected(self, positions: torch.Tensor, x: torch.Tensor, qkv_proj: nn.Module,
                         defer_merge: bool = False) -> torch.Tensor | PendingMerge:
        """Decode attention of x's tokens, qkv_proj through the K/V write as one kernel (a lone
        token whose decode takes the raw q, k, v: the decoder runs decode_new_token instead);
        defer_merge (Triton's decode): its splits unmerged, a PendingMerge for o_proj."""
        from nanovllm.kernels.linear.fused import qkv_rope_store
        ctx, norm, kv_scales = get_context(), self.q_norm is not None, (self.k_scale, self.v_scale)
        q = qkv_rope_store(x, qkv_proj.weight, qkv_proj.bias, self.num_heads, self.num_kv_heads,
                           positions, self.q_norm.weight if norm else None,
                           self.k_norm.weight if norm else None,
                           self.q_norm.eps if norm else 0.0, self.rotary_emb.cos_sin_cache,
                           self.k_cache, self.v_cache, ctx.slot_mapping, kv_scales,
                           lora=qkv_proj.lora_slots(), ahead=qkv_proj.take_lora_ahead(x),
                           **qkv_proj.fused_scales())
        # only Triton's decode takes defer_merge (the flag that says its keywords are taken)
        merge = {"defer_merge": True} if defer_merge and self.backend.can_decode_new_token \
            else {}
        return self.backend.decode(q, self.k_cache, self.v_cache, ctx, self.scale,
                                   self.sliding_window, kv_scales, **merge)

    def can_decode_new_token(self) -> bool:
        """Whether decode_new_token can run: takes_projection's, and a backend whose decode
        takes the raw q, k, v."""
        return self.takes_projection() and self.backend.can_decode_new_token

    def runs_decode_new_token(self, x: torch.Tensor, qkv_proj: nn.Module) -> bool:
        """Whether x's step runs decode_new_token: a layer that can_decode_new_token, and a lone
        token whose qkv_proj is a GEMV (at any limit measured for qkv_proj's fused kernel: that
        kernel does not run, and this path has one launch fewer)."""
        return self.can_decode_new_token() and qkv_proj.runs_gemv_rows(x)

    def decode_new_token(self, positions: torch.Tensor, qkv: torch.Tensor,
                         defer_merge: bool = False) -> torch.Tensor | PendingMerge:
        """Decode attention over qkv_proj's raw output [tokens, q + k + v], whose q/k norm,
        RoPE and K/V write the decode kernel does (kernels.attention.new_token); defer_merge:
        its splits unmerged, a PendingMerge for o_proj to merge."""
        from nanovllm.kernels.attention.new_token import NewToken
        ctx, norm = get_context(), self.q_norm is not None
        q, k, v = qkv.view(qkv.shape[0], -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        new = NewToken(k, v, positions, ctx.slot_mapping, self.rotary_emb.cos_sin_cache,
                       self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                       self.q_norm.eps if norm else 0.0)
        return self.backend.decode(q, self.k_cache, self.v_cache, ctx, self.scale,
                                   self.sliding_window, (self.k_scale, self.v_scale),
                                   new_token=new, defer_merge=defer_merge)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        ctx, backend = get_context(), self.backend
        q, k = backend.rope_and_store(self, positions, q, k, v)
        if self.kv_amax is not None:
            amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()
            self.kv_amax = torch.maximum(self.kv_amax, amax)
        kv_scales = (self.k_scale, self.v_scale)
        if ctx.is_prefill:
            return backend.prefill(q, k, v, self.k_cache, self.v_cache, ctx, self.scale,
                                   self.sliding_window, kv_scales)
        return backend.decode(q, self.k_cache, self.v_cache, ctx, self.scale,
                              self.sliding_window, kv_scales)


@contextmanager
def kv_scale_calibration(layers: list[Attention], device: torch.device) -> Iterator[None]:
    """Record each layer's max |K|, |V| inside; then scale = KV_SCALE_MARGIN * amax / 448."""
    for attn in layers:
        attn.kv_amax = torch.zeros(2, device=device)
    try:
        yield
        amax = torch.stack([attn.kv_amax for attn in layers]).tolist()  # one sync
        for attn, (k_amax, v_amax) in zip(layers, amax):
            attn.k_scale, attn.v_scale = (KV_SCALE_MARGIN * a / FP8_MAX if a > 0 else 1.0
                                          for a in (k_amax, v_amax))
        logger.info("FP8 KV scales from the warm-up: k %.3g..%.3g, v %.3g..%.3g",
                    *(f([getattr(a, name) for a in layers]) for name in ("k_scale", "v_scale")
                      for f in (min, max)))
    finally:
        for attn in layers:
            attn.kv_amax = None
