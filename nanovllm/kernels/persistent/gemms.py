"""kernels.persistent's GEMM phases: qkv_proj and gate_up_proj (normed_gemm), o_proj and
down_proj of a decode layer, each split over K into about one item a program, float32 partials
out."""
import triton
import triton.language as tl

from nanovllm.kernels.persistent.sync import split_item
from nanovllm.kernels.persistent.tiles import (
    BN,
    MERGE_SPLITS,
    T_P2,
    k_range,
    materialize,
    normed_tile,
    rstd_of,
    scaled_rows,
    store_partial,
    weight_dot,
)


@triton.jit
def normed_gemm(x_ptr, xpart_ptr, SX: tl.constexpr, add, keep_ptr, g_ptr, w_ptr, s_n, s_k, ws,
                part_ptr, pid, P, T, eps, NT: tl.constexpr, S: tl.constexpr, H: tl.constexpr,
                N: tl.constexpr, BK: tl.constexpr, PAIR: tl.constexpr, W_SCALE: tl.constexpr,
                PRECISION: tl.constexpr):
    """Phases 1 and 5: part[split] = RMSNorm(x)[:, split's K] @ W[:, split's K].T, x with `add`
    plus the partials of the projection before (tiles._residual_rows; program 0 keeps that sum
    in keep_ptr). With PAIR each item also computes the rows PAIR below its tile (gate_up_proj:
    a tile of gate rows with the same tile of up rows, NT tiles of gate rows)."""
    materialize(x_ptr, xpart_ptr, SX, add, keep_ptr, pid, T, H)
    rstd = rstd_of(x_ptr, xpart_ptr, SX, add, T, H, eps)
    K_LEN: tl.constexpr = H // S
    for item in range(pid, S * NT, P):
        split, tile = split_item(item, NT)
        n0 = tile * BN
        acc = tl.zeros([BN, T_P2], tl.float32)
        paired = tl.zeros([BN, T_P2], tl.float32)
        for k in range(split * K_LEN, (split + 1) * K_LEN, BK):
            x = normed_tile(x_ptr, xpart_ptr, SX, add, g_ptr, rstd, T, k, H, BK)
            acc = weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, acc, BK, W_SCALE, PRECISION)
            if PAIR > 0:
                paired = weight_dot(w_ptr, s_n, s_k, ws, PAIR + n0, k, x, paired, BK, W_SCALE,
                                    PRECISION)
        store_partial(part_ptr, scaled_rows(acc, ws, n0, W_SCALE), split, T, n0, N)
        if PAIR > 0:
            store_partial(part_ptr, scaled_rows(paired, ws, PAIR + n0, W_SCALE), split, T,
                          PAIR + n0, N)


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
            acc = weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, acc, D, W_SCALE, PRECISION)
        store_partial(part_ptr, scaled_rows(acc, ws, n0, W_SCALE), split, T, n0, H)


@triton.jit
def _act_tile(part5_ptr, S5: tl.constexpr, T, k, INTER: tl.constexpr, BK: tl.constexpr, dtype):
    """SiLU(gate) * up for columns k:+BK of every token ([BK, T_P2]), as silu_and_mul rounds."""
    offs_t = tl.arange(0, T_P2)
    cols = k_range(k, BK)
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
            acc = weight_dot(w_ptr, s_n, s_k, ws, n0, k, x, acc, BK, W_SCALE, PRECISION)
        store_partial(part_ptr, scaled_rows(acc, ws, n0, W_SCALE), split, T, n0, H)
