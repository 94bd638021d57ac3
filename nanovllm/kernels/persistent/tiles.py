"""Tiles and residual rows shared by kernels.persistent's phases: weight tiles (16-bit, or FP8
codes as W8A16), normed activation tiles, split partials and the residual adds."""
import triton
import triton.language as tl

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
def k_range(k, BK: tl.constexpr):
    """k:+BK, k a multiple of BK: the hint that lets a tile's loads be 16-byte vectors."""
    return tl.max_contiguous(tl.multiple_of(k + tl.arange(0, BK), BK), BK)


@triton.jit
def _w_tile(w_ptr, s_n, s_k, n0, k, BK: tl.constexpr):
    """Weight rows n0:+BN, columns k:+BK ([BN, BK]), as stored (either stride may be 1)."""
    return tl.load(w_ptr + (n0 + tl.arange(0, BN))[:, None] * s_n
                   + k_range(k, BK)[None, :] * s_k)


@triton.jit
def weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, acc, BK: tl.constexpr, W_SCALE: tl.constexpr,
                PRECISION: tl.constexpr):
    """acc + W[n0:+BN, k:+BK] @ x: a 16-bit weight, or FP8 codes as W8A16 with their block's
    scale (kernels.linear.fused_fp8; per channel the scales come after the K loop,
    scaled_rows). ws: the weight's (scales, row stride, weight rows a scale row)."""
    w = _w_tile(w_ptr, s_n, s_k, n0, k, BK)
    if W_SCALE == 0:
        return tl.dot(w, x, acc, input_precision=PRECISION)
    else:  # a block is K_STEP columns wide (fits_weight): o_proj's 64-wide head steps halve it
        return scaled_dot(w, x, acc, ws[0] + n0 // ws[2] * ws[1], k, SCALE_K, W_SCALE)


@triton.jit
def scaled_rows(acc, ws, n0, W_SCALE: tl.constexpr):
    """acc [BN, T_P2] times its rows' scales for per-channel FP8 (else unchanged)."""
    return channel_scaled(acc, channel_scales(ws[0] + n0 // ws[2] * ws[1], W_SCALE), W_SCALE)


@triton.jit
def normed_tile(x_ptr, part_ptr, S: tl.constexpr, add, g_ptr, rstd, T, k, H: tl.constexpr,
                 BK: tl.constexpr):
    """RMSNorm(residual)[:, k:+BK] transposed ([BK, T_P2]; _residual_rows), rounded as
    RMSNorm.rms_forward rounds."""
    offs_k = k_range(k, BK)
    x = _residual_rows(x_ptr, part_ptr, S, add, T, tl.arange(0, T_P2)[None, :],
                       offs_k[:, None], H)
    g = tl.load(g_ptr + offs_k)
    return ((x.to(tl.float32) * rstd[None, :]).to(x.dtype) * g[:, None]).to(x.dtype)


@triton.jit
def store_partial(part_ptr, acc, split, T, n0, N: tl.constexpr):
    """part[split, t, n0:+BN] = acc [BN, T_P2] (float32)."""
    offs_t = tl.arange(0, T_P2)[None, :]
    rows = (n0 + tl.arange(0, BN))[:, None]
    tl.store(part_ptr + (split * T + offs_t) * N + rows, acc, mask=offs_t < T)


@triton.jit
def sum_partials(part_ptr, S: tl.constexpr, T, t, cols, N: tl.constexpr, mask):
    """Sum over the S splits of part[s, t, cols] (float32, cols' shape; 0 where not mask)."""
    acc = tl.zeros(cols.shape, tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(part_ptr + (s * T + t) * N + cols, mask=mask, other=0.0,
                       cache_modifier=".cg")
    return acc


@triton.jit
def residual(part_ptr, S: tl.constexpr, res_ptr, out_ptr, pid, P, T, H: tl.constexpr):
    """Phases 4 and 7: out = residual + the partials' sum rounded (add + RMSNorm's add)."""
    offs = tl.arange(0, CHUNK)
    for item in range(pid, T * (H // CHUNK), P):
        t, chunk = split_item(item, H // CHUNK)
        cols = chunk * CHUNK + offs
        y = sum_partials(part_ptr, S, T, t, cols, H, cols < H).to(out_ptr.dtype.element_ty)
        r = tl.load(res_ptr + t * H + cols, cache_modifier=".cg")
        tl.store(out_ptr + t * H + cols, (y.to(tl.float32) + r.to(tl.float32)).to(y.dtype))
