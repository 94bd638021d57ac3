"""The phases of kernels.persistent.decode_layer: each runs its items (item = pid, pid + P,
...) and writes what the next phase reads; the caller puts a grid barrier between them."""
import triton
import triton.language as tl

from nanovllm.kernels.attention.decode import _attend_chunk
from nanovllm.kernels.attention.qk_norm_rope import _norm_rope
from nanovllm.kernels.linear.fused_fp8 import (
    K_STEP,
    channel_scaled,
    channel_scales,
    scaled_dot,
)
from nanovllm.kernels.persistent.sync import split_item

BN = tl.constexpr(64)  # output rows (weight rows) a GEMM item computes
T_P2 = tl.constexpr(16)  # token columns of every tile: the MMA's narrow side
MERGE_SPLITS = tl.constexpr(8)  # attention splits o_proj merges a load
SCALE_K = tl.constexpr(K_STEP)  # an FP8 scale block's columns (fused_fp8.fits_weight)
CHUNK = tl.constexpr(128)  # hidden columns a residual step reads at a time


@triton.jit
def _residual_rows(x_ptr, part_ptr, S: tl.constexpr, add, T, rows, cols, H: tl.constexpr):
    """x[rows, cols] (rows and cols broadcast to the block), with `add` plus the S partials'
    sum rounded to x's dtype first, the sum then rounded: the residual add's two roundings."""
    mask = rows < T
    x = tl.load(x_ptr + rows * H + cols, mask=mask, other=0.0, cache_modifier=".cg")
    if add != 0:
        y = tl.zeros(x.shape, tl.float32)
        for s in tl.static_range(S):
            y += tl.load(part_ptr + (s * T + rows) * H + cols, mask=mask, other=0.0,
                         cache_modifier=".cg")
        x = (y.to(x.dtype).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def rstd_of(x_ptr, part_ptr, S: tl.constexpr, add, T, H: tl.constexpr, eps):
    """1 / RMS of each token's residual row (_residual_rows; float32 [T_P2])."""
    rows = tl.arange(0, T_P2)[:, None]
    ss = tl.zeros([T_P2], tl.float32)
    for h in range(0, H, CHUNK):
        x = _residual_rows(x_ptr, part_ptr, S, add, T, rows, h + tl.arange(0, CHUNK)[None, :],
                           H)
        ss += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
    return tl.rsqrt(ss / H + eps)


@triton.jit
def materialize(x_ptr, part_ptr, S: tl.constexpr, add, out_ptr, pid, T, H: tl.constexpr):
    """With `add`, program 0 writes the residual rows (_residual_rows) to out, for the phases
    and the layer after; every program computes them for itself meanwhile."""
    if (add != 0) & (pid == 0):
        rows = tl.arange(0, T_P2)[:, None]
        for h in range(0, H, CHUNK):
            cols = h + tl.arange(0, CHUNK)[None, :]
            tl.store(out_ptr + rows * H + cols,
                     _residual_rows(x_ptr, part_ptr, S, add, T, rows, cols, H), mask=rows < T)


@triton.jit
def _k_range(k, BK: tl.constexpr):
    """k:+BK, k a multiple of BK: the hint that lets a tile's loads be 16-byte vectors."""
    return tl.max_contiguous(tl.multiple_of(k + tl.arange(0, BK), BK), BK)


@triton.jit
def _w_tile(w_ptr, s_n, s_k, n0, k, BK: tl.constexpr):
    """Weight rows n0:+BN, columns k:+BK ([BN, BK]), as stored (either stride may be 1)."""
    return tl.load(w_ptr + (n0 + tl.arange(0, BN))[:, None] * s_n
                   + _k_range(k, BK)[None, :] * s_k)


@triton.jit
def _weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, acc, BK: tl.constexpr, W_SCALE: tl.constexpr,
                PRECISION: tl.constexpr):
    """acc + W[n0:+BN, k:+BK] @ x: a 16-bit weight, or FP8 codes as W8A16 with their block's
    scale (kernels.linear.fused_fp8; per channel the scales come after the K loop,
    _channel_scaled). ws: the weight's (scales, row stride, weight rows a scale row)."""
    w = _w_tile(w_ptr, s_n, s_k, n0, k, BK)
    if W_SCALE == 0:
        return tl.dot(w, x, acc, input_precision=PRECISION)
    else:  # a block is K_STEP columns wide (fits_weight): o_proj's 64-wide head steps halve it
        return scaled_dot(w, x, acc, ws[0] + n0 // ws[2] * ws[1], k, SCALE_K, W_SCALE)


@triton.jit
def _channel_scaled(acc, ws, n0, W_SCALE: tl.constexpr):
    """acc [BN, T_P2] times its rows' scales for per-channel FP8 (else unchanged)."""
    return channel_scaled(acc, channel_scales(ws[0] + n0 // ws[2] * ws[1], W_SCALE), W_SCALE)


@triton.jit
def _normed_tile(x_ptr, part_ptr, S: tl.constexpr, add, g_ptr, rstd, T, k, H: tl.constexpr,
                 BK: tl.constexpr):
    """RMSNorm(residual)[:, k:+BK] transposed ([BK, T_P2]; _residual_rows), rounded as
    RMSNorm.rms_forward rounds."""
    offs_k = _k_range(k, BK)
    x = _residual_rows(x_ptr, part_ptr, S, add, T, tl.arange(0, T_P2)[None, :],
                       offs_k[:, None], H)
    g = tl.load(g_ptr + offs_k)
    return ((x.to(tl.float32) * rstd[None, :]).to(x.dtype) * g[:, None]).to(x.dtype)


@triton.jit
def _store_partial(part_ptr, acc, split, T, n0, N: tl.constexpr):
    """part[split, t, n0:+BN] = acc [BN, T_P2] (float32)."""
    offs_t = tl.arange(0, T_P2)[None, :]
    rows = (n0 + tl.arange(0, BN))[:, None]
    tl.store(part_ptr + (split * T + offs_t) * N + rows, acc, mask=offs_t < T)


@triton.jit
def _sum_partials(part_ptr, S: tl.constexpr, T, t, cols, N: tl.constexpr, mask):
    """Sum over the S splits of part[s, t, cols] (float32, cols' shape; 0 where not mask)."""
    acc = tl.zeros(cols.shape, tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(part_ptr + (s * T + t) * N + cols, mask=mask, other=0.0,
                       cache_modifier=".cg")
    return acc


@triton.jit
def normed_gemm(x_ptr, xpart_ptr, SX: tl.constexpr, add, g_ptr, w_ptr, s_n, s_k, ws, part_ptr,
                pid, P, T, eps, NT: tl.constexpr, S: tl.constexpr, H: tl.constexpr,
                N: tl.constexpr, BK: tl.constexpr, W_SCALE: tl.constexpr,
                PRECISION: tl.constexpr):
    """Phase 1: part[split] = RMSNorm(x)[:, split's K] @ W[:, split's K].T, x with `add` plus
    the layer before's down_proj partials (_residual_rows)."""
    rstd = rstd_of(x_ptr, xpart_ptr, SX, add, T, H, eps)
    K_LEN: tl.constexpr = H // S
    for item in range(pid, S * NT, P):
        split, tile = split_item(item, NT)
        n0 = tile * BN
        acc = tl.zeros([BN, T_P2], tl.float32)
        for k in range(split * K_LEN, (split + 1) * K_LEN, BK):
            x = _normed_tile(x_ptr, xpart_ptr, SX, add, g_ptr, rstd, T, k, H, BK)
            acc = _weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, acc, BK, W_SCALE, PRECISION)
        _store_partial(part_ptr, _channel_scaled(acc, ws, n0, W_SCALE), split, T, n0, N)


@triton.jit
def _norm_weights(w_ptr, HALF: tl.constexpr, NORM: tl.constexpr):
    """A q/k norm weight's halves [1, D/2] in float32 (zeros without NORM: unused)."""
    lo = tl.arange(0, HALF)[None, :]
    if NORM:
        return tl.load(w_ptr + lo).to(tl.float32), tl.load(w_ptr + HALF + lo).to(tl.float32)
    else:
        return tl.zeros([1, HALF], tl.float32), tl.zeros([1, HALF], tl.float32)


@triton.jit
def _qkv_halves(part1_ptr, S1: tl.constexpr, T, t, cols, mask, dtype, HALF: tl.constexpr,
                NQKV: tl.constexpr):
    """Token t's qkv at cols and cols + HALF (partials summed, rounded to dtype)."""
    return (_sum_partials(part1_ptr, S1, T, t, cols, NQKV, mask).to(dtype),
            _sum_partials(part1_ptr, S1, T, t, cols + HALF, NQKV, mask).to(dtype))


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
    w1, w2 = _norm_weights(qn_ptr, HALF, NORM)
    x1, x2 = _norm_rope(x1, x2, w1, w2, cos, sin, eps, dtype, D, NORM, 1)
    tl.store(q_ptr + (t * HQ + heads) * D + lo, x1, mask=g < GROUP)
    tl.store(q_ptr + (t * HQ + heads) * D + HALF + lo, x2, mask=g < GROUP)
    if write_kv:
        everything = lo < HALF
        k1, k2 = _qkv_halves(part1_ptr, S1, T, t, (HQ + kvh) * D + lo, everything, dtype, HALF,
                             NQKV)
        w1, w2 = _norm_weights(kn_ptr, HALF, NORM)
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


@triton.jit
def _merged_head(m_ptr, l_ptr, acc_ptr, NS, T, head, HQ: tl.constexpr, D: tl.constexpr,
                 dtype):
    """One head's attention output for every token, its splits merged ([D, T_P2], dtype): the
    decode reduce kernel's sum, as o_proj's x tile; MERGE_SPLITS splits a load."""
    offs_t = tl.arange(0, T_P2)
    offs_s = tl.arange(0, MERGE_SPLITS)
    row = ((offs_t * HQ + head) * NS)[:, None]  # [T_P2, 1]: split 0 of (t, head)
    m_max = tl.full([T_P2], float("-inf"), tl.float32)
    for s0 in range(0, NS, MERGE_SPLITS):
        ok = (offs_t[:, None] < T) & (s0 + offs_s[None, :] < NS)
        m = tl.load(m_ptr + row + s0 + offs_s[None, :], mask=ok, other=float("-inf"),
                    cache_modifier=".cg")
        m_max = tl.maximum(m_max, tl.max(m, axis=1))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # an empty context: zeros out
    denom = tl.zeros([T_P2], tl.float32)
    o = tl.zeros([T_P2, D], tl.float32)
    for s0 in range(0, NS, MERGE_SPLITS):
        ok = (offs_t[:, None] < T) & (s0 + offs_s[None, :] < NS)
        cells = row + s0 + offs_s[None, :]  # [T_P2, MERGE_SPLITS]
        w = tl.exp2(tl.load(m_ptr + cells, mask=ok, other=float("-inf"), cache_modifier=".cg")
                    - m_max[:, None])  # masked splits: weight 0
        denom += tl.sum(w * tl.load(l_ptr + cells, mask=ok, other=0.0, cache_modifier=".cg"),
                        axis=1)
        acc = tl.load(acc_ptr + cells[:, :, None] * D + tl.arange(0, D)[None, None, :],
                      mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        o += tl.sum(w[:, :, None] * acc, axis=1)
    return tl.trans(o / tl.where(denom == 0.0, 1.0, denom)[:, None]).to(dtype)


@triton.jit
def o_proj(m_ptr, l_ptr, acc_ptr, NS, w_ptr, s_n, s_k, ws, part_ptr, pid, P, T,
           NT: tl.constexpr, S: tl.constexpr, H: tl.constexpr, HQ: tl.constexpr,
           D: tl.constexpr, dtype: tl.constexpr, W_SCALE: tl.constexpr,
           PRECISION: tl.constexpr):
    """Phase 3: part[split] = attention[:, split's heads] @ W_o[:, split's heads].T."""
    K_LEN = HQ * D // S
    for item in range(pid, S * NT, P):
        split, tile = split_item(item, NT)
        n0 = tile * BN
        acc = tl.zeros([BN, T_P2], tl.float32)
        for k in range(split * K_LEN, (split + 1) * K_LEN, D):  # a head a K step
            x = _merged_head(m_ptr, l_ptr, acc_ptr, NS, T, k // D, HQ, D, dtype)
            acc = _weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, acc, D, W_SCALE, PRECISION)
        _store_partial(part_ptr, _channel_scaled(acc, ws, n0, W_SCALE), split, T, n0, H)


@triton.jit
def residual(part_ptr, S: tl.constexpr, res_ptr, out_ptr, pid, P, T, H: tl.constexpr):
    """Phases 4 and 7: out = residual + the partials' sum rounded (add + RMSNorm's add)."""
    offs = tl.arange(0, CHUNK)
    for item in range(pid, T * (H // CHUNK), P):
        t, chunk = split_item(item, H // CHUNK)
        cols = chunk * CHUNK + offs
        y = _sum_partials(part_ptr, S, T, t, cols, H, cols < H).to(out_ptr.dtype.element_ty)
        r = tl.load(res_ptr + t * H + cols, cache_modifier=".cg")
        tl.store(out_ptr + t * H + cols, (y.to(tl.float32) + r.to(tl.float32)).to(y.dtype))


@triton.jit
def _act_tile(part5_ptr, S5: tl.constexpr, T, k, INTER: tl.constexpr, BK: tl.constexpr, dtype):
    """SiLU(gate) * up for columns k:+BK of every token ([BK, T_P2]), as silu_and_mul rounds."""
    offs_t = tl.arange(0, T_P2)
    cols = _k_range(k, BK)
    ok = offs_t[None, :] < T
    gate = tl.zeros([BK, T_P2], tl.float32)
    up = tl.zeros([BK, T_P2], tl.float32)
    for s in tl.static_range(S5):
        row = (s * T + offs_t[None, :]) * (2 * INTER)
        gate += tl.load(part5_ptr + row + cols[:, None], mask=ok, other=0.0, cache_modifier=".cg")
        up += tl.load(part5_ptr + row + INTER + cols[:, None], mask=ok, other=0.0,
                      cache_modifier=".cg")
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def gate_up(x_ptr, xpart_ptr, SX: tl.constexpr, add, g_ptr, w_ptr, s_n, s_k, ws, part_ptr, pid,
            P, T, eps, NT: tl.constexpr, S: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
            BK: tl.constexpr, W_SCALE: tl.constexpr, PRECISION: tl.constexpr):
    """Phase 5: part[split] = RMSNorm(x)[:, split's K] @ [W_gate; W_up][:, split's K].T, each
    item a tile of gate rows with the same tile of up rows (part: [S, T, 2I]); x with `add`
    plus o_proj's partials (_residual_rows: phase 4 folded in)."""
    rstd = rstd_of(x_ptr, xpart_ptr, SX, add, T, H, eps)
    K_LEN: tl.constexpr = H // S
    for item in range(pid, S * NT, P):
        split, tile = split_item(item, NT)
        n0 = tile * BN
        gate = tl.zeros([BN, T_P2], tl.float32)
        up = tl.zeros([BN, T_P2], tl.float32)
        for k in range(split * K_LEN, (split + 1) * K_LEN, BK):
            x = _normed_tile(x_ptr, xpart_ptr, SX, add, g_ptr, rstd, T, k, H, BK)
            gate = _weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, gate, BK, W_SCALE, PRECISION)
            up = _weight_dot(w_ptr, s_n, s_k, ws, INTER + n0, k, x, up, BK, W_SCALE, PRECISION)
        _store_partial(part_ptr, _channel_scaled(gate, ws, n0, W_SCALE), split, T, n0,
                       2 * INTER)
        _store_partial(part_ptr, _channel_scaled(up, ws, INTER + n0, W_SCALE), split, T,
                       INTER + n0, 2 * INTER)


@triton.jit
def down(part5_ptr, S5: tl.constexpr, w_ptr, s_n, s_k, ws, part_ptr, pid, P, T,
         NT: tl.constexpr, S: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
         BK: tl.constexpr, dtype: tl.constexpr, W_SCALE: tl.constexpr,
         PRECISION: tl.constexpr):
    """Phase 6: part[split] = act[:, split's K] @ W_down[:, split's K].T."""
    K_LEN = INTER // S
    for item in range(pid, S * NT, P):
        split, tile = split_item(item, NT)
        n0 = tile * BN
        acc = tl.zeros([BN, T_P2], tl.float32)
        for k in range(split * K_LEN, (split + 1) * K_LEN, BK):
            x = _act_tile(part5_ptr, S5, T, k, INTER, BK, dtype)
            acc = _weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, acc, BK, W_SCALE, PRECISION)
        _store_partial(part_ptr, _channel_scaled(acc, ws, n0, W_SCALE), split, T, n0, H)
