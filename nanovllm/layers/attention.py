"""Attention over the paged KV cache, with the backend chosen once at start-up."""
import importlib.util
import logging
import os

import torch
from torch import nn

from nanovllm.utils.context import Context, get_context

logger = logging.getLogger(__name__)
BACKENDS = ("flash-attn", "triton", "torch")


class TorchBackend:
    """Plain torch: runs anywhere; the reference the kernels are tested against."""

    name = "torch"

    def __init__(self) -> None:
        from nanovllm.kernels import attention_torch, store_kvcache
        self.store_kvcache = store_kvcache.store_kvcache_torch
        self._prefill = attention_torch.prefill_attention_torch
        self._decode = attention_torch.decode_attention_torch

    def prefill(self, q, k, v, k_cache, v_cache, ctx: Context, scale: float) -> torch.Tensor:
        block_tables = ctx.block_tables if ctx.prefix_cached else None
        return self._prefill(q, k, v, k_cache, v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                             block_tables, scale, max_seqlen_q=ctx.max_seqlen_q)

    def decode(self, q, k_cache, v_cache, ctx: Context, scale: float) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, ctx.context_lens, ctx.block_tables, scale)


class TritonBackend(TorchBackend):
    """Our own Triton kernels: for GPUs without flash-attn."""

    name = "triton"

    def __init__(self) -> None:
        from nanovllm.kernels import attention_triton, store_kvcache
        self.store_kvcache = store_kvcache.store_kvcache
        self._prefill = attention_triton.prefill_attention_triton  # same signatures
        self._decode = attention_triton.decode_attention_triton


class FlashAttnBackend:
    """flash-attn: varlen prefill (paged when a prefix is cached) and paged decode."""

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from nanovllm.kernels.store_kvcache import store_kvcache
        self.store_kvcache = store_kvcache
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def prefill(self, q, k, v, k_cache, v_cache, ctx: Context, scale: float) -> torch.Tensor:
        if ctx.prefix_cached:
            k, v = k_cache, v_cache
        return self._varlen(q, k, v, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                            max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                            softmax_scale=scale, causal=True,
                            block_table=ctx.block_tables if ctx.prefix_cached else None)

    def decode(self, q, k_cache, v_cache, ctx: Context, scale: float) -> torch.Tensor:
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                 block_table=ctx.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)


def select_attention_backend(device: str, dtype: torch.dtype, name: str = "auto"):
    """flash-attn if importable on CUDA (fp16/bf16), else our Triton kernels; torch on CPU."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"attention backend {name!r} unknown; choose from {('auto', *BACKENDS)}")
    has_flash = importlib.util.find_spec("flash_attn") is not None
    half = dtype in (torch.float16, torch.bfloat16)  # FlashAttention has no float32 kernels
    if name == "auto":
        if device != "cuda":
            name = "torch"
        else:
            name = "flash-attn" if has_flash and half else "triton"
    if name == "flash-attn" and not has_flash:
        raise ImportError("attention backend 'flash-attn' needs flash-attn: "
                          "pip install 'nanovllm[flash]'")
    if name == "flash-attn" and not half:
        raise ValueError(f"attention backend 'flash-attn' needs float16 or bfloat16, not {dtype}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # Triton on CPU, for tests
    if device != "cuda" and not (name == "torch" or name == "triton" and interpreted):
        raise ValueError(f"attention backend {name!r} needs device='cuda'")
    backend = {"flash-attn": FlashAttnBackend, "triton": TritonBackend,
               "torch": TorchBackend}[name]()
    logger.info("attention backend: %s", name)
    return backend


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends; q/k/v are [N, heads, D]."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = None  # set with the KV cache by the ModelRunner

    def kv_store_args(self, v: torch.Tensor) -> tuple | None:
        """(v, k_cache, v_cache, slot_mapping) when this step writes the cache, else None."""
        slot_mapping = get_context().slot_mapping
        if self.k_cache.numel() and slot_mapping is not None:
            return v, self.k_cache, self.v_cache, slot_mapping
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                store_kv: bool = True) -> torch.Tensor:
        """store_kv=False: the caller has written this step's K/V already (fused kernel)."""
        ctx = get_context()
        k_cache, v_cache, backend = self.k_cache, self.v_cache, self.backend
        if store_kv and (kv_store := self.kv_store_args(v)):
            backend.store_kvcache(k, *kv_store)
        if ctx.is_prefill:
            return backend.prefill(q, k, v, k_cache, v_cache, ctx, self.scale)
        return backend.decode(q, k_cache, v_cache, ctx, self.scale)
