"""A one-token decode step's new token inside the decode kernel: q's and k's RMSNorm and RoPE,
the K/V cache write and the new key's softmax step, so that no q/k kernel runs between
qkv_proj's GEMV and attention (kernels.attention.decode, NEW_KV).

Each split program normalises and rotates its query heads itself (a few hundred bytes); the
program whose split holds the last position writes the new K/V to the cache and attends to
that key from registers, as the cache holds it (FP8: quantized), so that no program reads a
cache row this kernel writes.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.prefill import softmax_step
from nanovllm.kernels.attention.qk_norm_rope import _norm_rope, _token_inputs
from nanovllm.kernels.attention.store_kvcache import quantize_kv


class NewToken(NamedTuple):
    """A one-token step's raw k and v [B, Hkv, D] (views of qkv_proj's output, q's too) and
    what qk_norm_rope would take to write them."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm: torch.Tensor | None  # per-head RMSNorm weights (Qwen3), or None
    k_norm: torch.Tensor | None
    eps: float


@triton.jit
def new_token_inputs(pos_ptr, slot_ptr, cs_ptr, stride_cs, qn_w_ptr, kn_w_ptr, seq,
                     HEAD_DIM: tl.constexpr, NORM: tl.constexpr, NEW_KV: tl.constexpr):
    """(cos, sin, slot, q and k norm weights' halves) of seq's new token with NEW_KV, else
    zeros (unused): step inputs and weights, read before the PDL wait (kernels.pdl)."""
    if NEW_KV:
        cos, sin, slot, qw1, qw2, kw1, kw2 = _token_inputs(
            pos_ptr, slot_ptr, cs_ptr, stride_cs, qn_w_ptr, kn_w_ptr, seq.to(tl.int64),
            HEAD_DIM, NORM, True)
    else:
        cos = tl.zeros([1, HEAD_DIM // 2], tl.float32)
        sin, qw1, qw2, kw1, kw2 = cos, cos, cos, cos, cos
        slot = seq.to(tl.int64) * 0
    return cos, sin, slot, qw1, qw2, kw1, kw2


@triton.jit
def _join_halves(x1, x2, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[ROWS, D] rows from their halves [ROWS, D/2], x1 first."""
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (ROWS, HEAD_DIM))


@triton.jit
def query_tile(q_ptr, seq, stride_qb, stride_qh, heads, g_mask, cos, sin, w1, w2, eps,
               GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
               NEW_KV: tl.constexpr):
    """seq's query heads `heads` [GROUP_P2, D] (zeros where not g_mask): with NEW_KV the raw q
    normalised and rotated, as qk_norm_rope writes it; else q as given."""
    row = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
    if NEW_KV:
        HALF: tl.constexpr = HEAD_DIM // 2
        lo = tl.arange(0, HALF)[None, :]
        q1 = tl.load(row + lo, mask=g_mask[:, None], other=0.0)
        q2 = tl.load(row + HALF + lo, mask=g_mask[:, None], other=0.0)
        q1, q2 = _norm_rope(q1, q2, w1, w2, cos, sin, eps, q_ptr.dtype.element_ty, HEAD_DIM,
                            NORM, 1)
        q = _join_halves(q1, q2, GROUP_P2, HEAD_DIM)
    else:
        q = tl.load(row + tl.arange(0, HEAD_DIM)[None, :], mask=g_mask[:, None], other=0.0)
    return q


@triton.jit
def _store_halves(cache_ptr, slot, kv_head, x1, x2, inv_scale, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """x's halves [1, D/2] as the cache holds them (returned), stored to the cache row of
    (slot, kv_head) unless slot < 0 (a padding row)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    lo = tl.arange(0, HALF)[None, :]
    dtype = cache_ptr.dtype.element_ty
    c1 = quantize_kv(x1, inv_scale, dtype, FP8)
    c2 = quantize_kv(x2, inv_scale, dtype, FP8)
    dst = cache_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + lo
    mask = lo < tl.where(slot >= 0, HALF, 0)  # one comparison (the interpreter's bool & bool)
    tl.store(dst, c1, mask=mask)
    tl.store(dst + HALF, c2, mask=mask)
    return c1, c2


@triton.jit
def new_key_step(q, m_i, l_i, acc, k_ptr, v_ptr, row, k_cache_ptr, v_cache_ptr, slot, kv_head,
                 cos, sin, w1, w2, eps, k_inv_scale, v_inv_scale, qk_scale,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
                 NORM: tl.constexpr, FP8: tl.constexpr):
    """The new token's K/V of kv_head (raw k at k_ptr + row, v at v_ptr + row) to its cache
    slot, k normalised and rotated, and its online-softmax step: a 16-key tile whose key 0 is
    it, as the cache holds it, through softmax_step as a cache tile goes."""
    HALF: tl.constexpr = HEAD_DIM // 2
    lo = tl.arange(0, HALF)[None, :]
    k1 = tl.load(k_ptr + row + lo)
    k2 = tl.load(k_ptr + row + HALF + lo)
    v1 = tl.load(v_ptr + row + lo)
    v2 = tl.load(v_ptr + row + HALF + lo)
    k1, k2 = _norm_rope(k1, k2, w1, w2, cos, sin, eps, k_ptr.dtype.element_ty, HEAD_DIM, NORM, 1)
    k1, k2 = _store_halves(k_cache_ptr, slot, kv_head, k1, k2, k_inv_scale, NUM_KV_HEADS,
                           HEAD_DIM, FP8)
    v1, v2 = _store_halves(v_cache_ptr, slot, kv_head, v1, v2, v_inv_scale, NUM_KV_HEADS,
                           HEAD_DIM, FP8)
    first = (tl.arange(0, 16) == 0)[None, :]  # [1, 16]: key 0 of the tile
    k = tl.trans(_join_halves(k1, k2, 1, HEAD_DIM)).to(q.dtype)  # [D, 1]
    v = _join_halves(v1, v2, 1, HEAD_DIM).to(q.dtype)  # [1, D]
    k_t = k * first.to(q.dtype)  # [D, 16], zeros but key 0
    v_t = tl.trans(first).to(q.dtype) * v  # [16, D]
    return softmax_step(q, k_t, v_t, first, m_i, l_i, acc, qk_scale, PRECISION)


def new_token_args(new: NewToken | None, q: torch.Tensor, kv_scales: tuple[float, float]
                   ) -> dict:
    """The decode kernel's NEW_KV arguments (any tensors for the unused pointers without)."""
    if new is None:
        return dict(k_new_ptr=q, v_new_ptr=q, stride_nb=0, pos_ptr=q, slot_ptr=q, cs_ptr=q,
                    stride_cs=0, qn_w_ptr=q, kn_w_ptr=q, eps=0.0, k_inv_scale=1.0,
                    v_inv_scale=1.0, NEW_KV=False, NORM=False)
    batch, num_kv_heads, head_dim = new.k.shape
    assert new.v.shape == new.k.shape and new.k.stride()[1:] == (head_dim, 1)
    assert new.v.stride() == new.k.stride() and q.stride(2) == 1 and q.stride(1) == head_dim
    assert new.positions.shape == new.slot_mapping.shape == (batch,)
    assert new.cos_sin_cache.dtype == torch.float32 and new.cos_sin_cache.stride(-1) == 1
    norm = new.q_norm is not None
    return dict(k_new_ptr=new.k, v_new_ptr=new.v, stride_nb=new.k.stride(0),
                pos_ptr=new.positions, slot_ptr=new.slot_mapping, cs_ptr=new.cos_sin_cache,
                stride_cs=new.cos_sin_cache.stride(0),
                qn_w_ptr=new.q_norm if norm else new.cos_sin_cache,
                kn_w_ptr=new.k_norm if norm else new.cos_sin_cache, eps=new.eps,
                k_inv_scale=1.0 / kv_scales[0], v_inv_scale=1.0 / kv_scales[1], NEW_KV=True,
                NORM=norm)
