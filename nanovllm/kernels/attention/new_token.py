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
from nanovllm.kernels.attention.qk_norm_rope import (
    _load_heads,
    _norm_rope,
    _token_inputs,
    check_rope_args,
    store_kv_heads,
)


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
def cached_end(end, ctx, NEW_KV: tl.constexpr):
    """End of a split's keys read from the cache: with NEW_KV, before the new key (registers)."""
    if NEW_KV:
        end = tl.minimum(end, ctx - 1)
    return end


@triton.jit
def _join_halves(x1, x2, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[ROWS, D] rows from their halves [ROWS, D/2], x1 first."""
    return tl.reshape(tl.permute(tl.join(x1, x2), (0, 2, 1)), (ROWS, HEAD_DIM))


@triton.jit
def query_tile(q_ptr, seq, stride_qb, stride_qh, kv_head, cos, sin, w1, w2, eps,
               GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
               NORM: tl.constexpr, NEW_KV: tl.constexpr):
    """seq's GROUP query heads of kv_head [GROUP_P2, D] (padding rows 0): with NEW_KV the raw q
    normalised and rotated, as qk_norm_rope writes it; else q as given."""
    heads = q_ptr + seq * stride_qb + kv_head * GROUP * stride_qh
    if NEW_KV:
        q1, q2 = _load_heads(heads, stride_qh, GROUP, GROUP_P2, HEAD_DIM)
        q1, q2 = _norm_rope(q1, q2, w1, w2, cos, sin, eps, q_ptr.dtype.element_ty, HEAD_DIM,
                            NORM, 1)
        q = _join_halves(q1, q2, GROUP_P2, HEAD_DIM)
    else:
        rows = tl.arange(0, GROUP_P2)[:, None]
        q = tl.load(heads + rows * stride_qh + tl.arange(0, HEAD_DIM)[None, :],
                    mask=rows < GROUP, other=0.0)
    return q


@triton.jit
def new_kv_heads(k_ptr, v_ptr, row, holds_new, HEAD_DIM: tl.constexpr, NEW_KV: tl.constexpr):
    """The new token's raw k and v of one kv head (at k_ptr + row, v_ptr + row) as halves
    [1, D/2], read only by the split that holds it (zeros elsewhere, and without NEW_KV)."""
    # Called right after the PDL wait, beside q's loads: inside new_key_step, after the first
    # tile's softmax step and its barriers, they were a second round trip on the critical split.
    if NEW_KV:
        k1, k2 = _load_heads(k_ptr + row, 0, 1, 1, HEAD_DIM, holds_new)
        v1, v2 = _load_heads(v_ptr + row, 0, 1, 1, HEAD_DIM, holds_new)
    else:
        k1 = tl.zeros([1, HEAD_DIM // 2], k_ptr.dtype.element_ty)
        k2, v1, v2 = k1, k1, k1
    return k1, k2, v1, v2


@triton.jit
def new_key_step(q, m_i, l_i, acc, new_kv, k_cache_ptr, v_cache_ptr, slot, kv_head, cos, sin,
                 w1, w2, eps, k_inv_scale, v_inv_scale, qk_scale, NUM_KV_HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr):
    """The new token's K/V of kv_head (new_kv: new_kv_heads' raw halves) to its cache slot, k
    normalised and rotated, and its online-softmax step."""
    k1, k2, v1, v2 = new_kv
    k1, k2 = _norm_rope(k1, k2, w1, w2, cos, sin, eps, k1.dtype, HEAD_DIM, NORM, 1)
    head = tl.full([1, 1], kv_head, tl.int32)
    k1, k2 = store_kv_heads(k_cache_ptr, slot, head, k1, k2, k_inv_scale, NUM_KV_HEADS,
                            HEAD_DIM, FP8)
    v1, v2 = store_kv_heads(v_cache_ptr, slot, head, v1, v2, v_inv_scale, NUM_KV_HEADS,
                            HEAD_DIM, FP8)
    # The key as the cache holds it, on CUDA cores: one key needs no MMA, whose 16-key tile
    # staged q, k and p through shared memory behind ~10 barriers. p rounds to v's dtype as
    # the tile's PV product does, so acc's update is the same product and sum.
    k = _join_halves(k1, k2, 1, HEAD_DIM).to(q.dtype).to(tl.float32)  # [1, D]
    v = _join_halves(v1, v2, 1, HEAD_DIM).to(q.dtype)  # [1, D]
    qk = tl.sum(q.to(tl.float32) * k, axis=1) * qk_scale
    m_new = tl.maximum(m_i, qk)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def empty_state(GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(m, l, acc) of a split that has seen no key: -inf, 0, 0."""
    return (tl.full([GROUP_P2], float("-inf"), tl.float32), tl.zeros([GROUP_P2], tl.float32),
            tl.zeros([GROUP_P2, HEAD_DIM], tl.float32))


@triton.jit
def new_token_steps(q, tile, holds_new, new_kv, k_cache_ptr, v_cache_ptr, slot, kv_head, cos,
                    sin, w1, w2, eps, k_inv_scale, v_inv_scale, qk_scale,
                    GROUP_P2: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PRECISION: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
                    NEW_KV: tl.constexpr):
    """(m, l, acc) a split's loop starts from: empty, or NEW_KV's after `tile` and the new key."""
    m_i, l_i, acc = empty_state(GROUP_P2, HEAD_DIM)
    if NEW_KV:
        # The tile first, its registers then free for the new key's step. All its keys may be
        # hidden (an empty split; a window of 1, the new key alone): MAY_BE_HIDDEN then keeps
        # the state empty, not NaN.
        k_t, v, visible = tile
        m_i, l_i, acc = softmax_step(q, k_t.to(q.dtype), v.to(q.dtype), visible[None, :], m_i,
                                      l_i, acc, qk_scale, PRECISION, MAY_BE_HIDDEN=True)
        if holds_new:
            m_i, l_i, acc = new_key_step(q, m_i, l_i, acc, new_kv, k_cache_ptr, v_cache_ptr,
                                         slot, kv_head, cos, sin, w1, w2, eps, k_inv_scale,
                                         v_inv_scale, qk_scale, NUM_KV_HEADS, HEAD_DIM, NORM,
                                         FP8)
    return m_i, l_i, acc


def new_token_args(new: NewToken | None, q: torch.Tensor, kv_scales: tuple[float, float]
                   ) -> dict:
    """The decode kernel's NEW_KV arguments (any tensors for the unused pointers without)."""
    if new is None:
        return dict(k_new_ptr=q, v_new_ptr=q, stride_nb=0, pos_ptr=q, slot_ptr=q, cs_ptr=q,
                    stride_cs=0, qn_w_ptr=q, kn_w_ptr=q, eps=0.0, k_inv_scale=1.0,
                    v_inv_scale=1.0, NEW_KV=False, NORM=False)
    batch, num_kv_heads, head_dim = new.k.shape
    check_rope_args(head_dim, q.dtype, new.q_norm, new.k_norm, new.cos_sin_cache)
    assert new.v.shape == new.k.shape and new.k.stride()[1:] == (head_dim, 1)
    assert new.v.stride() == new.k.stride() and q.stride(2) == 1 and q.stride(1) == head_dim
    assert new.k.dtype == new.v.dtype == q.dtype
    assert new.positions.shape == new.slot_mapping.shape == (batch,)
    norm = new.q_norm is not None
    return dict(k_new_ptr=new.k, v_new_ptr=new.v, stride_nb=new.k.stride(0),
                pos_ptr=new.positions, slot_ptr=new.slot_mapping, cs_ptr=new.cos_sin_cache,
                stride_cs=new.cos_sin_cache.stride(0),
                qn_w_ptr=new.q_norm if norm else new.cos_sin_cache,
                kn_w_ptr=new.k_norm if norm else new.cos_sin_cache, eps=new.eps,
                k_inv_scale=1.0 / kv_scales[0], v_inv_scale=1.0 / kv_scales[1], NEW_KV=True,
                NORM=norm)
