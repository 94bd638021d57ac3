"""Decode projections that carry the kernel after them: qkv_proj with q/k norm + RoPE + the K/V
cache write in its epilogue, gate_up_proj with SiLU-and-mul in its; o_proj and down_proj run
split over K (kernels.linear.split_k) with the same tiles and helpers. Which decode steps run
them start-up measures per shape (layers.fused_calibration); gate_up's kernel is
kernels.linear.fused_gate_up, on this module's pair GEMM.

The GEMMs are swap-AB and TMA-fed: a batch of at most a few hundred tokens is too narrow for
the MMA's 64-row side, so the weight's rows take it (out^T = W @ x^T) and the tokens the narrow
side; weight and token tiles arrive by TMA through a multi-stage pipeline. Each program owns
one head (two 64-row halves, the pair neox RoPE rotates together) or 64 gate rows with their
64 up rows, for BLOCK_T tokens (their gains against cuBLAS: docs/design.md).

FP8 weights run as W8A16, a constexpr branch (W_SCALE; kernels.linear.fused_fp8 says how, and
why). LoRA slots add their delta in the epilogue (kernels.linear.lora says where the shrink is
computed)."""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE
from nanovllm.kernels.attention.qk_norm_rope import _norm_rope, load_norm_weight, qk_norm_rope
from nanovllm.kernels.attention.store_kvcache import quantize_kv
from nanovllm.kernels.linear.fused_fp8 import (
    K_STEP,
    TILE_ROWS,
    Block,
    channel_scaled,
    channel_scales,
    fits_weight,
    num_sms,
    resident_stages,
    scale_args,
    scaled_dot,
    weight_stages,
)
from nanovllm.kernels.linear.gemv import gemv_rows, runs_gemv_rows
from nanovllm.kernels.linear.lora import (
    LoRAAhead,
    LoRASlots,
    add_lora,
    ahead_args,
    ahead_shrunk,
    fused_lora_args,
    lora_keep,
)
from nanovllm.kernels.pdl import (
    PREFETCH_STEPS,
    launch_options,
    prefetch_tile,
    prefetches,
    wait_then_release,
)

ROWS = TILE_ROWS  # weight rows per MMA tile: a half head, or a gate or up slice


@triton.jit
def pair_gemm(w_desc, x_desc, row_a, row_b, tok0, K, s_ptr, stride_s, scale_rows, a_desc,
               b_desc, slots_ptr, ahead_ptr, rstd_ptr, M, slice_a, slice_b,
               BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
               W_SCALE: tl.constexpr, LORA_K: tl.constexpr, RANK: tl.constexpr,
               PAIR_SLICES: tl.constexpr, AHEAD: tl.constexpr, AHEAD_SR: tl.constexpr):
    """(W[row_a:+64] @ x.T, W[row_b:+64] @ x.T) for tokens tok0:+BLOCK_T, float32 [64, T]
    each (token rows past the batch load as zeros); FP8 codes times their scales (W_SCALE). The
    epilogues work in this orientation: transposing the accumulators costs more than the
    stores' poorer coalescing. With LoRA (LORA_K = slots x rank > 0) each adds its delta
    (kernels.linear.lora.add_lora) of LoRA slice slice_a (PAIR_SLICES: the second accumulator's
    is slice_b, else slice_a too): the shrink is 64 more MMA rows in the K loop, or with AHEAD
    (the norm's chunks) read from the RMSNorm before (kernels.linear.lora.ahead_shrunk)."""
    s_a = s_ptr + row_a // scale_rows * stride_s  # the tiles' rows of scales
    s_b = s_ptr + row_b // scale_rows * stride_s
    scale_a, scale_b = channel_scales(s_a, W_SCALE), channel_scales(s_b, W_SCALE)
    acc_a = tl.zeros([64, BLOCK_T], tl.float32)
    acc_b = tl.zeros([64, BLOCK_T], tl.float32)
    shrunk_a = tl.zeros([64, BLOCK_T], tl.float32)
    shrunk_b = tl.zeros([64, BLOCK_T], tl.float32)
    if LORA_K > 0:  # requested before the K loop, so that their latency hides behind it
        keep = lora_keep(slots_ptr, tok0, M, LORA_K, RANK, BLOCK_T)
        b_a = b_desc.load([row_a, 0])
        b_b = b_desc.load([row_b, 0])
        if AHEAD:
            shrunk_a = ahead_shrunk(ahead_ptr, rstd_ptr, keep, tok0, M, slice_a, AHEAD_SR, RANK,
                                    AHEAD, BLOCK_T)
            if PAIR_SLICES:
                shrunk_b = ahead_shrunk(ahead_ptr, rstd_ptr, keep, tok0, M, slice_b, AHEAD_SR,
                                        RANK, AHEAD, BLOCK_T)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([tok0, k]).T
        acc_a = scaled_dot(w_desc.load([row_a, k]), x, acc_a, s_a, k, BLOCK_K, W_SCALE)
        acc_b = scaled_dot(w_desc.load([row_b, k]), x, acc_b, s_b, k, BLOCK_K, W_SCALE)
        if LORA_K > 0 and not AHEAD:
            shrunk_a = tl.dot(a_desc.load([slice_a * LORA_K, k]), x, shrunk_a)
            if PAIR_SLICES:
                shrunk_b = tl.dot(a_desc.load([slice_b * LORA_K, k]), x, shrunk_b)
    acc_a = channel_scaled(acc_a, scale_a, W_SCALE)
    acc_b = channel_scaled(acc_b, scale_b, W_SCALE)
    if LORA_K > 0:
        acc_a = add_lora(acc_a, shrunk_a, b_a, keep)
        if PAIR_SLICES:
            acc_b = add_lora(acc_b, shrunk_b, b_b, keep)
        else:
            acc_b = add_lora(acc_b, shrunk_a, b_b, keep)
    return acc_a, acc_b


@triton.jit
def _store_head(x1, x2, head, toks, tok_ok, slot, lo, w1, w2, cos, sin, eps, q_out_ptr,
                k_cache_ptr, v_cache_ptr, k_inv_scale, v_inv_scale, NUM_Q_HEADS: tl.constexpr,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
                FP8: tl.constexpr):
    """One head's two float32 halves [HEAD_DIM / 2, tokens], rounded as the projection's output
    is, to where they go: a q head normed and rotated into q_out, a k head normed and rotated
    into the cache, a v head into the cache (slot < 0: a padding row, not written)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = q_out_ptr.dtype.element_ty
    x1 = x1.to(dtype)
    x2 = x2.to(dtype)
    kv_ok = tok_ok & (slot >= 0)
    kv_dtype = k_cache_ptr.dtype.element_ty
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        x1, x2 = _norm_rope(x1, x2, w1, w2, cos, sin, eps, dtype, HEAD_DIM, NORM, 0)
        if head < NUM_Q_HEADS:
            q_dst = q_out_ptr + (toks * NUM_Q_HEADS + head) * HEAD_DIM + lo
            tl.store(q_dst, x1, mask=tok_ok)
            tl.store(q_dst + HALF, x2, mask=tok_ok)
        else:  # (names differ per branch: Triton types a name once, and caches may be FP8)
            k_dst = k_cache_ptr + (slot * NUM_KV_HEADS + head - NUM_Q_HEADS) * HEAD_DIM + lo
            tl.store(k_dst, quantize_kv(x1, k_inv_scale, kv_dtype, FP8), mask=kv_ok)
            tl.store(k_dst + HALF, quantize_kv(x2, k_inv_scale, kv_dtype, FP8), mask=kv_ok)
    else:
        kv_head = head - NUM_Q_HEADS - NUM_KV_HEADS
        v_dst = v_cache_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + lo
        tl.store(v_dst, quantize_kv(x1, v_inv_scale, kv_dtype, FP8), mask=kv_ok)
        tl.store(v_dst + HALF, quantize_kv(x2, v_inv_scale, kv_dtype, FP8), mask=kv_ok)


# M, the step's token count, only masks: specialising on it (1, multiple of 16) would compile
# variants per batch size.
@triton.jit(do_not_specialize=["M"])
def _qkv_rope_store_kernel(w_desc, x_desc, bias_ptr, q_out_ptr, qn_w_ptr, kn_w_ptr, pos_ptr,
                           cs_ptr, stride_cs, k_cache_ptr, v_cache_ptr, slot_ptr, M, K, eps,
                           k_inv_scale, v_inv_scale, s_ptr, stride_s, scale_rows, a_desc,
                           b_desc, lora_slots_ptr, ahead_ptr, rstd_ptr, w_ptr,
                           NUM_Q_HEADS: tl.constexpr,
                           NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HAS_BIAS: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                           USE_PDL: tl.constexpr, W_SCALE: tl.constexpr, LORA_K: tl.constexpr,
                           RANK: tl.constexpr, AHEAD: tl.constexpr,
                           AHEAD_SR: tl.constexpr, ELEM_BYTES: tl.constexpr,
                           PREFETCH: tl.constexpr):
    """Grid (q + k + v heads, token tiles): one head's projection for BLOCK_T tokens; q heads
    normed, rotated and stored to q_out, k heads normed, rotated and written to the cache, v
    heads written to the cache (slot < 0: a padding row, not written). With PREFETCH the
    head's first weight tiles are asked of L2 before the wait (w_ptr: the weight)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    head = tl.program_id(0)
    prefetch_tile(w_ptr, head * HEAD_DIM, 0, K, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, K,
                  HEAD_DIM, PREFETCH_STEPS * BLOCK_K * ELEM_BYTES, ELEM_BYTES, PREFETCH)
    wait_then_release(USE_PDL)
    tok0 = tl.program_id(1) * BLOCK_T
    # Everything the epilogue reads besides the products is requested before the K loop, so
    # that its memory latency hides behind the loop's instead of following it.
    lo = tl.arange(0, HALF)[:, None]
    toks = tok0 + tl.arange(0, BLOCK_T)[None, :]
    tok_ok = toks < M
    toks = toks.to(tl.int64)
    slot = tl.load(slot_ptr + toks, mask=tok_ok, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + toks, mask=tok_ok, other=0).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + lo)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + lo)
    if head < NUM_Q_HEADS:
        nw = qn_w_ptr
    else:
        nw = kn_w_ptr
    w1, w2 = load_norm_weight(nw, HEAD_DIM, NORM, 0)
    if HAS_BIAS:
        b1 = tl.load(bias_ptr + head * HEAD_DIM + lo).to(tl.float32)
        b2 = tl.load(bias_ptr + head * HEAD_DIM + HALF + lo).to(tl.float32)
    # the head's LoRA slice: q, k or v
    lora_slice = tl.where(head < NUM_Q_HEADS, 0, tl.where(head < NUM_Q_HEADS + NUM_KV_HEADS,
                                                          1, 2))
    # [D/2, tokens]: neox RoPE pairs dim i with i + D/2, the two accumulators
    x1, x2 = pair_gemm(w_desc, x_desc, head * HEAD_DIM, head * HEAD_DIM + HALF, tok0, K,
                        s_ptr, stride_s, scale_rows, a_desc, b_desc, lora_slots_ptr, ahead_ptr,
                        rstd_ptr, M, lora_slice, lora_slice, BLOCK_T, BLOCK_K, STAGES, W_SCALE,
                        LORA_K, RANK, False, AHEAD, AHEAD_SR)
    if HAS_BIAS:
        x1 += b1
        x2 += b2
    _store_head(x1, x2, head, toks, tok_ok, slot, lo, w1, w2, cos, sin, eps, q_out_ptr,
                k_cache_ptr, v_cache_ptr, k_inv_scale, v_inv_scale, NUM_Q_HEADS, NUM_KV_HEADS,
                HEAD_DIM, NORM, FP8)


# fits_*: dtype is the activations', weight_dtype (None: the same) and w_block as fits_weight's
# (fits_gate_up: kernels.linear.fused_gate_up)
def fits_qkv(hidden_size: int, head_dim: int, dtype: torch.dtype,
             weight_dtype: torch.dtype | None = None, w_block: Block = None) -> bool:
    """Whether qkv_rope_store takes these sizes: 16-bit activations, half heads of exactly one
    64-row MMA tile, rows of a 16-byte multiple (TMA)."""
    return fits_weight(dtype, weight_dtype or dtype, w_block) and head_dim == 2 * ROWS \
        and hidden_size % 64 == 0


def _launch(num_tokens: int, weight: torch.Tensor, lora: LoRASlots | None,
            ahead: LoRAAhead | None, programs: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_K, STAGES, num_warps) for a batch (the H200 sweep: docs/design.md).
    A's tiles in the K loop leave room for fewer stages (gate_up's: 80 KB a stage at 64 tokens).
    Up to 16 tokens, more programs than SMs get the stages that keep them all resident (beside
    B's tiles, with a shrink computed ahead): one wave, not a partial second one."""
    assert ahead is None or (lora is not None and ahead.lora_a is lora[0]
                             and ahead.slots is lora[2])
    a_tiles = lora is not None and ahead is None
    stages = weight_stages(num_tokens, weight)
    if num_tokens > 16:
        return (32 if num_tokens <= 128 else 64), K_STEP, 2 if a_tiles else stages, 4
    if a_tiles:
        return 16, K_STEP, 3, 4
    stage = 2 * ROWS * K_STEP * weight.element_size() + 16 * K_STEP * 2  # 2 W tiles + x
    b_tiles = 0 if ahead is None else 2 * ROWS * 64 * 2
    return 16, K_STEP, resident_stages(stages, programs, sms, stage, b_tiles), 4


def weight_args(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None,
                 w_block: Block, lora: LoRASlots | None, ahead: LoRAAhead | None,
                 programs: int) -> dict:
    """Both kernels' arguments for the GEMM part: weight and token tiles (TMA), scales, LoRA,
    the weight to prefetch, and _launch's tiles for `programs` weight programs."""
    assert x.stride(-1) == 1 and weight.is_contiguous() and weight.shape[1] == x.shape[1]
    block_t, block_k, stages, warps = _launch(x.shape[0], weight, lora, ahead, programs,
                                              num_sms(x.device))
    s_ptr, stride_s, scale_rows, w_scale_kind = scale_args(weight, w_scale, w_block)
    return dict(w_desc=TensorDescriptor.from_tensor(weight, [ROWS, block_k]),
                x_desc=TensorDescriptor.from_tensor(x, [block_t, block_k]), s_ptr=s_ptr,
                stride_s=stride_s, scale_rows=scale_rows, **fused_lora_args(lora, block_k),
                **ahead_args(ahead), w_ptr=weight, BLOCK_T=block_t, BLOCK_K=block_k,
                STAGES=stages, W_SCALE=w_scale_kind, ELEM_BYTES=weight.element_size(),
                PREFETCH=prefetches(block_t), num_warps=warps, **launch_options())


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0), *,
                   w_scale: torch.Tensor | None = None, w_block: Block = None,
                   lora: LoRASlots | None = None, ahead: LoRAAhead | None = None
                   ) -> torch.Tensor:
    """q [M, Hq, D] = RoPE(norm(x @ Wq.T + bq)); k and v (k normed and rotated) go to their
    cache slots, as qkv_proj (with its LoRA delta) followed by qk_norm_rope with kv_store does.
    An FP8 weight comes with w_scale (per channel, or per w_block block:
    kernels.linear.fused_fp8). One token without LoRA runs kernels.linear.gemv's rows, then
    qk_norm_rope: one program a head leaves most SMs idle there."""
    num_tokens, hidden = x.shape
    head_dim = weight.shape[0] // (num_q_heads + 2 * num_kv_heads)
    assert fits_qkv(hidden, head_dim, x.dtype, weight.dtype, w_block)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1
    if lora is None and runs_gemv_rows(x, weight, w_scale, w_block):
        q, k, v = gemv_rows(x, weight, bias, w_scale).view(
            1, num_q_heads + 2 * num_kv_heads, head_dim).split(
            [num_q_heads, num_kv_heads, num_kv_heads], dim=1)
        return qk_norm_rope(q, k, positions, q_norm, k_norm, cos_sin_cache, eps,
                            (v, k_cache, v_cache, slot_mapping), kv_scales)[0]
    q = torch.empty(num_tokens, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    heads = num_q_heads + 2 * num_kv_heads
    args = weight_args(x, weight, w_scale, w_block, lora, ahead, heads)
    norm = q_norm is not None
    _qkv_rope_store_kernel[(heads, triton.cdiv(num_tokens, args["BLOCK_T"]))](
        bias_ptr=bias if bias is not None else weight, q_out_ptr=q,
        qn_w_ptr=q_norm if norm else cos_sin_cache, kn_w_ptr=k_norm if norm else cos_sin_cache,
        pos_ptr=positions, cs_ptr=cos_sin_cache, stride_cs=cos_sin_cache.stride(0),
        k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_ptr=slot_mapping, M=num_tokens, K=hidden,
        eps=eps, k_inv_scale=1.0 / kv_scales[0], v_inv_scale=1.0 / kv_scales[1],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HAS_BIAS=bias is not None, NORM=norm, FP8=k_cache.dtype == FP8_DTYPE, **args)
    return q
