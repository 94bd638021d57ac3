"""Fused per-head q/k RMSNorm (optional) + neox RoPE (+ the K/V cache write): one kernel instead
of four."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE
from nanovllm.kernels.attention.store_kvcache import quantize_kv
from nanovllm.kernels.pdl import launch_options, wait_then_release


@triton.jit
def _load_heads(src, stride_h, HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
                HEAD_DIM: tl.constexpr, present=True):
    """One token's heads [HEADS, D] as two halves [HEADS_P2, D/2] (padding rows 0, and all rows
    0 where not `present`): neox RoPE pairs element i with i + D/2, so the kernel works on the
    halves separately."""
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, HEADS_P2)[:, None]
    lo = tl.arange(0, HALF)[None, :]
    mask = (heads < HEADS) & present
    return (tl.load(src + heads * stride_h + lo, mask=mask, other=0.0),
            tl.load(src + heads * stride_h + HALF + lo, mask=mask, other=0.0))


@triton.jit
def load_norm_weight(w_ptr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, AXIS: tl.constexpr):
    """The norm weight's halves in float32, along AXIS as _norm_rope takes them: [1, D/2] with
    AXIS 1, [D/2, 1] with AXIS 0 (zeros without NORM: unused)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    lo = tl.expand_dims(tl.arange(0, HALF), 1 - AXIS)
    if NORM:
        return tl.load(w_ptr + lo).to(tl.float32), tl.load(w_ptr + HALF + lo).to(tl.float32)
    else:
        return tl.zeros(lo.shape, tl.float32), tl.zeros(lo.shape, tl.float32)


@triton.jit
def _token_inputs(pos_ptr, slot_ptr, cache_ptr, stride_cache, q_w_ptr, k_w_ptr, tok,
                  HEAD_DIM: tl.constexpr, NORM: tl.constexpr, STORE_KV: tl.constexpr):
    """(cos, sin, slot, q and k norm weights' halves) of one token: the step's inputs and
    weights, which no kernel of the step writes, so the kernel loads them before its PDL wait
    (slot 0 without STORE_KV: unused)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    lo = tl.arange(0, HALF)[None, :]
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64) if STORE_KV else tok * 0
    qw1, qw2 = load_norm_weight(q_w_ptr, HEAD_DIM, NORM, 1)
    kw1, kw2 = load_norm_weight(k_w_ptr, HEAD_DIM, NORM, 1)
    cos = tl.load(cache_ptr + pos * stride_cache + lo)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + lo)
    return cos, sin, slot, qw1, qw2, kw1, kw2


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps, dtype, HEAD_DIM: tl.constexpr,
               NORM: tl.constexpr, AXIS: tl.constexpr):
    """RoPE(RMSNorm(x)) (RoPE(x) without NORM) of heads given as halves: [heads, D/2] with
    AXIS 1, [D/2, tokens] with AXIS 0 (the axis a head's elements run along)."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # RMSNorm.rms_forward: normalise in float32, round to the input dtype, then multiply by
    # the weight in the input dtype. For bf16/fp16 the float32 product of two such values is
    # exact, so rounding it once equals their own multiply (for float32 the casts are no-ops).
    if NORM:
        rstd = tl.expand_dims(tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=AXIS) / HEAD_DIM + eps), AXIS)
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    # apply_rotary_emb: float32 rotation with cos_sin_cache[pos] = cat(cos, sin).
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_w_ptr, k_w_ptr, pos_ptr,
                         cache_ptr, stride_qn, stride_qh, stride_kn, stride_kh, stride_cache,
                         eps, v_ptr, stride_vn, stride_vh, k_cache_ptr, v_cache_ptr, slot_ptr,
                         k_inv_scale, v_inv_scale,
                         NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                         Q_HEADS_P2: tl.constexpr, KV_HEADS_P2: tl.constexpr,
                         HEAD_DIM: tl.constexpr, STORE_KV: tl.constexpr, NORM: tl.constexpr,
                         FP8: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (N,): normalise and rotate every q and k head of one token (one program per token,
    not per head: prefill launches ~16k programs, not ~400k); with STORE_KV also write the
    rotated k and the v to the token's cache slot."""
    tok = tl.program_id(0).to(tl.int64)  # int64 offsets, as in the other kernels: no overflow
    HALF: tl.constexpr = HEAD_DIM // 2
    lo = tl.arange(0, HALF)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    cos, sin, slot, qw1, qw2, kw1, kw2 = _token_inputs(
        pos_ptr, slot_ptr, cache_ptr, stride_cache, q_w_ptr, k_w_ptr, tok, HEAD_DIM, NORM,
        STORE_KV)
    wait_then_release(USE_PDL)
    # Every load is issued before any store: the compiler cannot move a load above a store to
    # a pointer that might alias it, so each load after a store was one more memory round trip.
    q1, q2 = _load_heads(q_ptr + tok * stride_qn, stride_qh, NUM_Q_HEADS, Q_HEADS_P2, HEAD_DIM)
    k1, k2 = _load_heads(k_ptr + tok * stride_kn, stride_kh, NUM_KV_HEADS, KV_HEADS_P2,
                         HEAD_DIM)
    if STORE_KV:
        v1, v2 = _load_heads(v_ptr + tok * stride_vn, stride_vh, NUM_KV_HEADS, KV_HEADS_P2,
                             HEAD_DIM)
    q1, q2 = _norm_rope(q1, q2, qw1, qw2, cos, sin, eps, dtype, HEAD_DIM, NORM, 1)
    k1, k2 = _norm_rope(k1, k2, kw1, kw2, cos, sin, eps, dtype, HEAD_DIM, NORM, 1)
    heads = tl.arange(0, Q_HEADS_P2)[:, None]
    dst = q_out_ptr + (tok * NUM_Q_HEADS + heads) * HEAD_DIM + lo
    tl.store(dst, q1, mask=heads < NUM_Q_HEADS)
    tl.store(dst + HALF, q2, mask=heads < NUM_Q_HEADS)
    heads = tl.arange(0, KV_HEADS_P2)[:, None]
    mask = heads < NUM_KV_HEADS
    dst = k_out_ptr + (tok * NUM_KV_HEADS + heads) * HEAD_DIM + lo
    tl.store(dst, k1, mask=mask)
    tl.store(dst + HALF, k2, mask=mask)
    if STORE_KV:  # store_kvcache fused in: saves a launch per layer
        store_kv_heads(k_cache_ptr, slot, heads, k1, k2, k_inv_scale, NUM_KV_HEADS, HEAD_DIM,
                       FP8)
        store_kv_heads(v_cache_ptr, slot, heads, v1, v2, v_inv_scale, NUM_KV_HEADS, HEAD_DIM,
                       FP8)


@triton.jit
def store_kv_heads(cache_ptr, slot, heads, x1, x2, inv_scale, NUM_KV_HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """The halves [heads, D/2] of x as the cache holds them (returned; FP8: x / scale rounded),
    stored to cache rows (slot, heads); heads from NUM_KV_HEADS and slot < 0 (a padding row)
    are not stored. The cache is contiguous [num_slots, Hkv, D]: int64 offsets past 2^31."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = cache_ptr.dtype.element_ty
    c1 = quantize_kv(x1, inv_scale, dtype, FP8)
    c2 = quantize_kv(x2, inv_scale, dtype, FP8)
    # one comparison, not mask & (slot >= 0): triton 3.9's interpreter makes that int32
    mask = heads < tl.where(slot >= 0, NUM_KV_HEADS, 0)
    dst = cache_ptr + (slot * NUM_KV_HEADS + heads) * HEAD_DIM + tl.arange(0, HALF)[None, :]
    tl.store(dst, c1, mask=mask)
    tl.store(dst + HALF, c2, mask=mask)
    return c1, c2


def check_rope_args(head_dim: int, dtype: torch.dtype, q_weight: torch.Tensor | None,
                    k_weight: torch.Tensor | None, cos_sin_cache: torch.Tensor) -> None:
    """What the kernels' norm and RoPE take: a power-of-two head_dim, both norm weights (or
    neither) in the activation dtype, a float32 [positions, head_dim] cos/sin cache."""
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    if q_weight is not None:
        assert q_weight.dtype == k_weight.dtype == dtype, "weights in the activation dtype"
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
    else:
        assert k_weight is None
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[-1] == head_dim
    assert cos_sin_cache.stride(-1) == 1


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos_sin_cache: torch.Tensor, eps: float, kv_store: tuple | None = None,
                 kv_scales: tuple[float, float] = (1.0, 1.0)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE(RMSNorm(q)), RoPE(RMSNorm(k)) as new contiguous tensors; q [N, Hq, D], k [N, Hkv, D].
    Without weights (None) no norm: RoPE(q), RoPE(k).

    kv_store = (v, k_cache, v_cache, slot_mapping) also does store_kvcache's work: the rotated
    k and v [N, Hkv, D] go to caches [num_blocks, block_size, Hkv, D]; a slot < 0 skips. An
    FP8 cache stores k / kv_scales[0] and v / kv_scales[1].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and k.dtype == q.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    check_rope_args(head_dim, q.dtype, q_weight, k_weight, cos_sin_cache)
    assert positions.shape == (num_tokens,)
    norm = q_weight is not None
    if not norm:  # unused pointers
        q_weight = k_weight = cos_sin_cache
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if kv_store is None:  # unused pointers: any tensor will do
        v, k_cache, v_cache, slot_mapping = k, k_out, k_out, positions
    else:
        v, k_cache, v_cache, slot_mapping = kv_store
        assert v.shape == k.shape and v.stride(-1) == 1 and v.dtype == k.dtype
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (k.dtype, FP8_DTYPE)
        assert k_cache.shape[-2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
        assert slot_mapping.shape == (num_tokens,)
    if num_tokens > 0:
        _qk_norm_rope_kernel[(num_tokens,)](
            q, k, q_out, k_out, q_weight, k_weight, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), eps,
            v, v.stride(0), v.stride(1), k_cache, v_cache, slot_mapping,
            1.0 / kv_scales[0], 1.0 / kv_scales[1],
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
            Q_HEADS_P2=triton.next_power_of_2(num_q_heads),
            KV_HEADS_P2=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
            STORE_KV=kv_store is not None, NORM=norm, FP8=k_cache.dtype == FP8_DTYPE,
            **launch_options())
    return q_out, k_out
