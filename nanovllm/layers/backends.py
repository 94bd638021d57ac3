"""Every kernel choice in one place, made once per run, in this order:

1. resolve_attention_backend (backend_names.py; Config calls it): which attention backend runs
   ('auto': triton on CUDA, the fastest measured; torch elsewhere);
2. select_backend: that backend, with its FastPath (plan_fast_path): which fused kernels run;
3. bind_backend: each layer gets what it runs; layers and models never choose kernels.

A backend has one interface: `rope_and_store` (q/k norm, RoPE, the K/V write), `prefill`,
`decode`, `select_experts` and `fused_moe` (a MoE layer's routing and experts), and
`fp8_linear` (FP8 weights: W8A16 split-K up to 16 tokens, else W8A8;
layers.quantization; the fused decode projections take FP8 weights as W8A16,
kernels.linear.fused_fp8). "torch" runs
anywhere and is the reference; the others run the Triton kernels on CUDA. Kernel modules are
imported lazily: CPU runs never import Triton.

An FP8 KV cache's prefill reads this step's K/V back from the cache, so every query sees the same
quantized keys whether or not its prefix was cached. flash-attn never serves it: the installed
build takes descale factors through **kwargs and ignores them.
"""
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.backend_names import BACKENDS
from nanovllm.layers.fused_calibration import layer_class
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import LinearBase, RowParallelLinear
from nanovllm.layers.packed_linear import MergedColumnParallelLinear, QKVParallelLinear
from nanovllm.utils.context import Context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastPath:
    """Which fused kernels a run uses (all off: plain torch, the kernels' reference)."""

    # RMSNorm (+ the residual add), SiLU-and-mul, and q/k norm + RoPE + K/V write as Triton
    # kernels (kernels.fused_ops, kernels.attention.qk_norm_rope), in every step
    fused_ops: bool = False
    # Decode projections carrying the kernel after them (kernels.linear.fused), in decode steps
    # of at most the FUSED_*_MAX_TOKENS below, in the layers whose shapes the kernels take
    fused_projections: bool = False
    # The sampler's fast path (temperature alone) as one Triton kernel (kernels.sample)
    fused_sampler: bool = False

    @property
    def any(self) -> bool:
        """Whether any fused kernel runs."""
        return self.fused_ops or self.fused_projections or self.fused_sampler


# The largest decode step, in tokens, that runs each projection's fused kernel until start-up
# measures it on the model's own shapes (layers.fused_calibration, on CUDA), and the limits
# bound when NANOVLLM_FUSED_LIMITS=fixed (A/B runs): up to there each beat cuBLAS + the kernel
# it absorbs on the H200 for Qwen3-0.6B's shapes (docs/design.md).
FUSED_QKV_MAX_TOKENS = 256  # qkv_proj + q/k norm + RoPE + K/V write (QKVParallelLinear)
FUSED_GATE_UP_MAX_TOKENS = 64  # gate_up_proj + SiLU-and-mul (MergedColumnParallelLinear)
FUSED_SPLIT_K_MAX_TOKENS = 256  # o_proj and down_proj as split-K partials (RowParallelLinear)


def measures_fused_limits(fast_path: FastPath) -> bool:
    """Whether start-up measures the fused projections' limits (else the fixed ones stay)."""
    return fast_path.fused_projections and os.environ.get("NANOVLLM_FUSED_LIMITS") != "fixed"


def plan_fast_path(name: str, device: str) -> FastPath:
    """Fused ops on CUDA but for torch (the reference); fused projections from sm_90 (TMA); the
    fused sampler on CUDA with every backend."""
    fused_ops = device == "cuda" and name != "torch"
    return FastPath(fused_ops=fused_ops,
                    fused_projections=fused_ops and torch.cuda.get_device_capability()[0] >= 9,
                    fused_sampler=device == "cuda")


class TorchBackend:
    """Plain torch: runs anywhere; the reference the kernels are tested against."""

    name = "torch"
    cuda_graphs = False  # decode reads context lengths on the host: it cannot be captured
    # Whether the scheduler orders decode batches longest context first. Triton's decode kernel
    # starts its programs in batch order, so long sequences start first and short ones fill in
    # behind; free for torch, whose CPU tests then run the row order the Triton kernels get.
    longest_first = True
    # decode takes the Triton kernel's keywords: a NewToken, defer_merge (TritonBackend)
    can_decode_new_token = False

    def __init__(self, fast_path: FastPath = FastPath()) -> None:
        from nanovllm.kernels.attention import reference as attention
        from nanovllm.kernels.attention import store_kvcache
        from nanovllm.kernels.linear import fp8_reference, lora_reference
        from nanovllm.kernels.moe import reference as moe
        self.fast_path = fast_path
        self.runs_triton = fast_path.any  # so the runner warms its kernels up (runner.warmup)
        self.fused_moe = moe.fused_moe_torch
        self.select_experts = moe.select_experts_torch
        self.lora_shrink = lora_reference.lora_shrink_torch
        self.lora_expand = lora_reference.lora_expand  # every backend's: one GEMM per slice
        self.fp8_linear = fp8_reference.fp8_linear_torch  # W8A8 layers (layers.quantization)
        self.fp8_takes_codes = None  # fp8_linear's steps that take TokenCodes: none
        self.store_kvcache = store_kvcache.store_kvcache_torch
        self._prefill = attention.prefill_attention_torch
        self._decode = attention.decode_attention_torch

    def rope_and_store(self, attn: nn.Module, positions: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE(norm(q)), RoPE(norm(k)) (no norm when attn has none), writing K/V to the cache."""
        kv_store = attn.kv_store_args(v)
        kv_scales = (attn.k_scale, attn.v_scale)
        if self.fast_path.fused_ops:
            from nanovllm.kernels.attention.qk_norm_rope import qk_norm_rope
            norm = attn.q_norm is not None
            return qk_norm_rope(q, k, positions, attn.q_norm.weight if norm else None,
                                attn.k_norm.weight if norm else None,
                                attn.rotary_emb.cos_sin_cache,
                                attn.q_norm.eps if norm else 0.0, kv_store, kv_scales)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rotary_emb(positions, q, k)
        if kv_store:
            self.store_kvcache(k, *kv_store, *kv_scales)
        return q, k

    def prefill(self, q, k, v, k_cache, v_cache, ctx: Context, scale: float,
                sliding_window: int | None, kv_scales: tuple[float, float] = (1.0, 1.0)
                ) -> torch.Tensor:
        # An FP8 cache is always read back (see the module docstring); block_tables is set
        # whenever the step writes the cache.
        paged = ctx.block_tables is not None and (ctx.prefix_cached or k_cache.dtype == FP8_DTYPE)
        return self._prefill(q, k, v, k_cache, v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                             ctx.block_tables if paged else None, scale,
                             max_seqlen_q=ctx.max_seqlen_q, sliding_window=sliding_window,
                             k_scale=kv_scales[0], v_scale=kv_scales[1])

    def decode(self, q, k_cache, v_cache, ctx: Context, scale: float,
               sliding_window: int | None, kv_scales: tuple[float, float] = (1.0, 1.0),
               **kernel_kw) -> torch.Tensor:
        """Decode attention; kernel_kw are the kernel's own (Triton's new_token: q, k and v as
        qkv_proj's output, normalised, rotated and written to the cache inside)."""
        return self._decode(q, k_cache, v_cache, ctx.context_lens, ctx.block_tables, scale,
                            sliding_window=sliding_window, k_scale=kv_scales[0],
                            v_scale=kv_scales[1], **kernel_kw)


class TritonBackend(TorchBackend):
    """Our own Triton kernels: for GPUs without flash-attn."""

    name = "triton"
    cuda_graphs = True
    can_decode_new_token = True  # a lone token's q/k norm, RoPE and K/V write inside decode

    def __init__(self, fast_path: FastPath = FastPath()) -> None:
        from nanovllm.kernels.attention import decode, prefill, store_kvcache
        from nanovllm.kernels.linear import fp8_gemm, lora, lora_reference
        from nanovllm.kernels.moe import fused_moe, routing
        self.fast_path = fast_path
        self.runs_triton = True
        self.fused_moe = fused_moe.fused_moe
        self.select_experts = routing.select_experts
        self.lora_shrink = lora.lora_shrink
        self.lora_expand = lora_reference.lora_expand
        self.fp8_linear = fp8_gemm.fp8_linear
        self.fp8_takes_codes = fp8_gemm.takes_token_codes
        self.store_kvcache = store_kvcache.store_kvcache
        self._prefill = prefill.prefill_attention_triton  # same signatures
        self._decode = decode.decode_attention_triton


class FlashAttnBackend(TorchBackend):
    """flash-attn: varlen prefill (paged when a prefix is cached) and paged decode."""

    name = "flash-attn"
    cuda_graphs = True
    longest_first = False  # FA3 schedules its own work: sorted either way it ran 5% slower

    def __init__(self, fast_path: FastPath = FastPath()) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from nanovllm.kernels.attention.store_kvcache import store_kvcache
        from nanovllm.kernels.linear.fp8_gemm import fp8_linear, takes_token_codes
        from nanovllm.kernels.linear.lora import lora_shrink
        from nanovllm.kernels.linear.lora_reference import lora_expand
        from nanovllm.kernels.moe.fused_moe import fused_moe
        from nanovllm.kernels.moe.routing import select_experts
        self.fast_path = fast_path
        self.runs_triton = True  # its K/V write, experts and our fused ops
        self.fused_moe = fused_moe
        self.select_experts = select_experts
        self.lora_shrink = lora_shrink
        self.lora_expand = lora_expand
        self.fp8_linear = fp8_linear
        self.fp8_takes_codes = takes_token_codes
        self.store_kvcache = store_kvcache
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    @staticmethod
    def _window(sliding_window: int | None) -> dict:
        # flash-attn counts the keys left of the query, the query excluded (its default:
        # unbounded, left out so that any flash-attn build without the keyword still works)
        return {} if sliding_window is None else {"window_size": (sliding_window - 1, 0)}

    def prefill(self, q, k, v, k_cache, v_cache, ctx: Context, scale: float,
                sliding_window: int | None, kv_scales: tuple[float, float] = (1.0, 1.0)
                ) -> torch.Tensor:
        assert k_cache.dtype != FP8_DTYPE, "flash-attn never gets an FP8 cache"
        if ctx.prefix_cached:
            k, v = k_cache, v_cache
        return self._varlen(q, k, v, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                            max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                            softmax_scale=scale, causal=True,
                            **self._window(sliding_window),
                            block_table=ctx.block_tables if ctx.prefix_cached else None)

    def decode(self, q, k_cache, v_cache, ctx: Context, scale: float,
               sliding_window: int | None, kv_scales: tuple[float, float] = (1.0, 1.0)
               ) -> torch.Tensor:
        assert k_cache.dtype != FP8_DTYPE, "flash-attn never gets an FP8 cache"
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                 block_table=ctx.block_tables, softmax_scale=scale, causal=True,
                                 **self._window(sliding_window))
        return out.squeeze(1)


def select_backend(name: str, device: str, kv_cache_dtype: str = "auto") -> TorchBackend:
    """Backend `name` (resolved by Config) with its fast path; logs the kernel choice once."""
    assert name in BACKENDS, "Config.attention_backend is resolved before any backend is built"
    fast_path = plan_fast_path(name, device)
    backend = {"flash-attn": FlashAttnBackend, "triton": TritonBackend,
               "torch": TorchBackend}[name](fast_path)
    logger.info("kernels: attention %s; q/k norm + RoPE + K/V write, RMSNorm, SiLU-and-mul: %s%s; "
                "experts (MoE) and FP8 GEMMs: %s%s", name,
                "fused Triton kernels" if fast_path.fused_ops else "torch",
                " (in decode, q/k norm + RoPE + K/V write and SiLU-and-mul inside qkv_proj and "
                "gate_up_proj, o_proj and down_proj split over K; FP8 weights there as W8A16)"
                if fast_path.fused_projections else "",
                "torch" if name == "torch" else "Triton (per-channel FP8: torch._scaled_mm)",
                "; no CUDA graphs (eager decode)" if device == "cuda" and not backend.cuda_graphs
                else "")
    if kv_cache_dtype == "fp8":
        logger.info("FP8 KV cache: read and written by the %s kernels (never flash-attn: the "
                    "installed build ignores FP8 descale factors)", name)
    return backend


def _fused_decode_max_tokens(linear: LinearBase) -> int:
    """The FUSED_*_MAX_TOKENS of a projection with a fused decode kernel; 0 for any other."""
    if isinstance(linear, QKVParallelLinear):
        return FUSED_QKV_MAX_TOKENS
    if isinstance(linear, MergedColumnParallelLinear):
        return FUSED_GATE_UP_MAX_TOKENS
    if isinstance(linear, RowParallelLinear):
        return FUSED_SPLIT_K_MAX_TOKENS
    return 0


def bind_backend(model: nn.Module, backend: TorchBackend,
                 fused_limits: dict[tuple, int] | None = None) -> None:
    """Give each layer what it runs, from the backend and its fast path (again: replaces it);
    fused_limits: measured {layer class: largest fused decode step} (fused_calibration)."""
    fast_path = backend.fast_path
    # attention and experts: the backend; RMSNorm and SiLU-and-mul: their Triton kernel or not;
    # projections: the largest decode step that runs their fused kernel (0: none, also where
    # the kernel does not take the layer's shapes; with LoRA slots it adds the delta as one
    # more K step) and the LoRA ops
    for module in model.modules():
        if isinstance(module, (Attention, FusedMoE)):
            module.backend = backend
        elif isinstance(module, (RMSNorm, SiluAndMul)):
            module.fused = fast_path.fused_ops
        elif isinstance(module, LinearBase):
            # FP8 layers too, in the formats the kernels take (per channel, 128-wide blocks),
            # and LoRA layers (the delta inside the kernels)
            lora = module.lora_a is not None
            fits = fast_path.fused_projections and module.fits_fused_decode()
            limit = _fused_decode_max_tokens(module)
            if fused_limits is not None:
                limit = fused_limits.get(layer_class(module), limit)
            module.fused_decode = fits
            module.fused_decode_max_tokens = limit if fits else 0
            module.lora_shrink = backend.lora_shrink if lora else None
            module.lora_expand = backend.lora_expand if lora else None
            module.fp8_linear = backend.fp8_linear if module.quant is not None else None
            # TokenCodes come from the Triton norm and SiLU-and-mul kernels only
            module.fp8_takes_codes = backend.fp8_takes_codes \
                if module.quant is not None and fast_path.fused_ops else None
