"""kernels.persistent's attention phase: each (token, kv head, split) item norms and rotates its
queries from qkv_proj's partials and attends its split of the paged context."""
import triton
import triton.language as tl

from nanovllm.kernels.attention.decode import _attend_chunk
from nanovllm.kernels.attention.qk_norm_rope import _load_weight, _norm_rope
from nanovllm.kernels.persistent.sync import split_item
from nanovllm.kernels.persistent.tiles import sum_partials


@triton.jit
def _qkv_halves(part1_ptr, S1: tl.constexpr, T, t, cols, mask, dtype, HALF: tl.constexpr,
                NQKV: tl.constexpr):
    """Token t's qkv at cols and cols + HALF (partials summed, rounded to dtype)."""
    return (sum_partials(part1_ptr, S1, T, t, cols, NQKV, mask).to(dtype),
            sum_partials(part1_ptr, S1, T, t, cols + HALF, NQKV, mask).to(dtype))


@triton.jit
def _rope_store(part1_ptr, S1: tl.constexpr, T, t, kvh, q_ptr, qn_ptr, kn_ptr, cos_sin_ptr,
                pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, eps, write_kv, HQ: tl.constexpr,
                HKV: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    """Token t's query heads of kv head kvh normed and rotated into q (every split of the pair
    writes the same values); with write_kv its k, normed and rotated, and v into its slot."""
    GROUP: tl.constexpr = HQ // HKV
    HALF: tl.constexpr = D // 2
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    lo = tl.arange(0, HALF)[None, :]
    g = tl.arange(0, G_P2)[:, None]
    dtype = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * D + lo)
    sin = tl.load(cos_sin_ptr + pos * D + HALF + lo)
    heads = kvh * GROUP + g
    x1, x2 = _qkv_halves(part1_ptr, S1, T, t, heads * D + lo, g < GROUP, dtype, HALF, NQKV)
    w1, w2 = _load_weight(qn_ptr, D, NORM)
    x1, x2 = _norm_rope(x1, x2, w1, w2, cos, sin, eps, dtype, D, NORM, 1)
    tl.store(q_ptr + (t * HQ + heads) * D + lo, x1, mask=g < GROUP)
    tl.store(q_ptr + (t * HQ + heads) * D + HALF + lo, x2, mask=g < GROUP)
    if write_kv:
        everything = lo < HALF
        k1, k2 = _qkv_halves(part1_ptr, S1, T, t, (HQ + kvh) * D + lo, everything, dtype, HALF,
                             NQKV)
        w1, w2 = _load_weight(kn_ptr, D, NORM)
        k1, k2 = _norm_rope(k1, k2, w1, w2, cos, sin, eps, dtype, D, NORM, 1)
        v1, v2 = _qkv_halves(part1_ptr, S1, T, t, (HQ + HKV + kvh) * D + lo, everything, dtype,
                             HALF, NQKV)
        dst = (tl.load(slot_ptr + t).to(tl.int64) * HKV + kvh) * D + lo
        kv_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, k1.to(kv_dtype))
        tl.store(k_cache_ptr + dst + HALF, k2.to(kv_dtype))
        tl.store(v_cache_ptr + dst, v1.to(kv_dtype))
        tl.store(v_cache_ptr + dst + HALF, v2.to(kv_dtype))


@triton.jit
def attention(part1_ptr, S1: tl.constexpr, q_ptr, qn_ptr, kn_ptr, cos_sin_ptr, pos_ptr,
              slot_ptr, k_cache_ptr, v_cache_ptr, ctx_ptr, bt_ptr, stride_bt, m_ptr, l_ptr,
              acc_ptr, NS, pid, P, T, eps, qk_scale, HQ: tl.constexpr, HKV: tl.constexpr,
              G_P2: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              BLOCK_N: tl.constexpr, NORM: tl.constexpr, PRECISION: tl.constexpr):
    """Phase 2: one item a (token, kv head, split of its context): the group's query heads,
    normed and rotated from qkv_proj's partials, over the split's keys (kernels.attention.
    decode's loop), softmax partials [T, HQ, NS]. The split holding the token's own position
    first writes its K/V to the cache, which no other split reads."""
    GROUP: tl.constexpr = HQ // HKV
    PAGES: tl.constexpr = 16
    offs_g = tl.arange(0, G_P2)
    offs_d = tl.arange(0, D)
    offs_p = tl.arange(0, PAGES)
    for item in range(pid, T * HKV * NS, P):
        rest, split = split_item(item, NS)
        t, kvh = split_item(rest, HKV)
        ctx = tl.load(ctx_ptr + t)
        split_len = tl.cdiv(tl.cdiv(ctx, NS), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, ctx)
        own = (start <= ctx - 1) & (ctx - 1 < end) & (tl.load(slot_ptr + t) >= 0)
        _rope_store(part1_ptr, S1, T, t, kvh, q_ptr, qn_ptr, kn_ptr, cos_sin_ptr, pos_ptr,
                    slot_ptr, k_cache_ptr, v_cache_ptr, eps, own, HQ, HKV, G_P2, D, NORM)
        tl.debug_barrier()  # the program's q rows and K/V are written before any thread reads
        heads = kvh * GROUP + offs_g
        q = tl.load(q_ptr + (t * HQ + heads[:, None]) * D + offs_d[None, :],
                    mask=offs_g[:, None] < GROUP, other=0.0, cache_modifier=".cg")
        m_i = tl.full([G_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([G_P2], tl.float32)
        acc = tl.zeros([G_P2, D], tl.float32)
        end_page = tl.cdiv(end, BLOCK_SIZE)
        for page0 in range(start // BLOCK_SIZE, end_page, PAGES):
            pages = tl.load(bt_ptr + t * stride_bt + page0 + offs_p,
                            mask=page0 + offs_p < end_page, other=0)
            m_i, l_i, acc = _attend_chunk(
                q, k_cache_ptr, v_cache_ptr, pages, page0,
                tl.maximum(start, page0 * BLOCK_SIZE),
                tl.minimum(end, (page0 + PAGES) * BLOCK_SIZE),
                0, kvh, m_i, l_i, acc, qk_scale, HKV, D, BLOCK_SIZE, BLOCK_N, PAGES, PRECISION,
                False)
        part = ((t * HQ + heads) * NS + split)
        ok = offs_g < GROUP
        tl.store(m_ptr + part, m_i, mask=ok)
        tl.store(l_ptr + part, l_i, mask=ok)
        tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=ok[:, None])
