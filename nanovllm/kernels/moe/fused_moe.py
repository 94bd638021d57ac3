"""Fused mixture-of-experts in Triton: tokens grouped by expert, two grouped GEMMs, top-k sum.

Each (token, k) pair is a "slot" (M * K of them). Slots are sorted by expert and each expert's
group is padded to a multiple of BLOCK_M, so every row block of the grouped GEMMs belongs to
one expert:

    sorted_ids:  [e0 e0 e0 pad | e2 e2 pad pad | e5 ...]   (slot ids; pad = M * K)
    expert_ids:  [    e0       |      e2       |  e5 ...]   (one per BLOCK_M rows)

The padded length is bounded from shapes alone, and the grouping runs in three small kernels
(up to ONE_PROGRAM_SLOTS slots in one program, one launch instead of five: on the H200 a batch-1
decode step of the Qwen3-30B-A3B shape went from 4,696 to 4,467-4,478 us of GPU time, alternated
x2, and batch 16 was even), so a decode step has no host sync and can be captured in a CUDA
graph; blocks past the real padded length (num_padded, on the device) return at once.

FP8 experts (W8A8, kernels.linear.fp8_reference's layout): both GEMMs read FP8 codes of the
activations (quantized per token group beforehand) and of the weights, and scale each K step's
product by its token group's and weight block's scales, as kernels.linear.fp8_gemm does for one
linear layer.

Tile sizes and launch options come from kernels.moe.config: a table measured per shape on the
GPU (benchmarks/moe_sweep.py), else a fixed default.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.linear.fp8_quant import per_token_group_quant
from nanovllm.kernels.moe.config import MoEConfig, moe_config
from nanovllm.kernels.moe.moe_sum import moe_sum
from nanovllm.kernels.pdl import launch_options, wait_then_release

# moe_align_block_size groups up to here in one program, whose loops run serially: up to 1,024
# slots the standard workload on the 30B-A3B shape measured 0.976x (one round)
ONE_PROGRAM_SLOTS = 128


@triton.jit
def _row_block(sorted_ids_ptr, num_padded_ptr, num_slots, BLOCK_M: tl.constexpr):
    """This program's slots, their mask, and whether the block holds any rows at all."""
    pid_m = tl.program_id(0)
    live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return slots, slots < num_slots, live


@triton.jit
def _scaled_dot(a, b, acc, a_scale_ptrs, b_scale_ptrs, row_mask, n_mask, k0, group_k,
                PRECISION: tl.constexpr, FP8: tl.constexpr):
    """acc + a . b; for FP8 codes times the step's token-group and weight-block scales."""
    if FP8:
        a_s = tl.load(a_scale_ptrs + k0 // group_k, mask=row_mask, other=0.0)
        b_s = tl.load(b_scale_ptrs + k0 // group_k, mask=n_mask, other=0.0)
        return acc + tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    return tl.dot(a, b, acc, input_precision=PRECISION)


# num_slots (tokens x top_k) and num_blocks change every step: specialising on them would
# compile variants per batch size.
@triton.jit(do_not_specialize=["num_slots"])
def _gate_up_silu_kernel(x_ptr, w13_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                         num_slots, top_k, N, K, stride_xm, stride_we, stride_wn, stride_hm,
                         xs_ptr, ws_ptr, stride_xsm, stride_wse, stride_wsn, group_n, group_k,
                         PRECISION: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """h[slot, n] = silu(x[token] . w1[e, n]) * (x[token] . w3[e, n]) for one row/column tile."""
    wait_then_release(USE_PDL)
    slots, row_mask, live = _row_block(sorted_ids_ptr, num_padded_ptr, num_slots, BLOCK_M)
    if live:
        expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
        tokens = (slots // top_k).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
        # [BLOCK_K, BLOCK_N] tiles of w1[e]^T (rows 0..N) and w3[e]^T (rows N..2N)
        g_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + N * stride_wn
        # FP8 scales: the token's groups, and the gate and up rows' blocks of this expert
        xs_ptrs = xs_ptr + tokens * stride_xsm
        gs_ptrs = ws_ptr + expert * stride_wse + (offs_n // group_n) * stride_wsn
        us_ptrs = ws_ptr + expert * stride_wse + ((offs_n + N) // group_n) * stride_wsn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k + k0 < K
            a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            g = tl.load(g_ptrs + k0, mask=w_mask, other=0.0)
            u = tl.load(u_ptrs + k0, mask=w_mask, other=0.0)
            acc_g = _scaled_dot(a, g, acc_g, xs_ptrs, gs_ptrs, row_mask, n_mask, k0, group_k,
                                PRECISION, FP8)
            acc_u = _scaled_dot(a, u, acc_u, xs_ptrs, us_ptrs, row_mask, n_mask, k0, group_k,
                                PRECISION, FP8)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        h_ptrs = h_ptr + slots[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(h_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                 num_padded_ptr, num_slots, N, K, stride_hm, stride_we, stride_wn, stride_om,
                 hs_ptr, ws_ptr, stride_hsm, stride_wse, stride_wsn, group_n, group_k,
                 PRECISION: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """out[slot, n] = topk_weight[slot] * (h[slot] . w2[e, n]) for one row/column tile."""
    wait_then_release(USE_PDL)
    slots, row_mask, live = _row_block(sorted_ids_ptr, num_padded_ptr, num_slots, BLOCK_M)
    if live:
        expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
        rows = slots.to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :]
        b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        hs_ptrs = hs_ptr + rows * stride_hsm
        bs_ptrs = ws_ptr + expert * stride_wse + (offs_n // group_n) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k + k0 < K
            a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = _scaled_dot(a, b, acc, hs_ptrs, bs_ptrs, row_mask, n_mask, k0, group_k,
                              PRECISION, FP8)
        weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * weight[:, None].to(tl.float32)
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _count_kernel(ids_ptr, counts_ptr, num_slots, BLOCK: tl.constexpr):
    """counts[e] += the slots of this chunk routed to expert e."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_slots
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + expert, 1, mask=mask)


@triton.jit
def _group_starts(counts, e_mask, expert_ids_ptr, num_padded_ptr, num_experts, num_blocks,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Each expert's padded group start (returned), the padded total, and the expert of every
    row block (how many groups end at or before its first row)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for b0 in range(0, num_blocks, CHUNK):
        block = b0 + tl.arange(0, CHUNK)
        done = (ends[None, :] <= block[:, None] * BLOCK_M) & e_mask[None, :]
        expert = tl.minimum(tl.sum(done.to(tl.int32), axis=1), num_experts - 1)
        tl.store(expert_ids_ptr + block, expert, mask=block < num_blocks)
    return ends - padded


@triton.jit(do_not_specialize=["num_blocks"])
def _offsets_kernel(counts_ptr, starts_ptr, expert_ids_ptr, num_padded_ptr, num_experts,
                    num_blocks, BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    """Each expert's padded group start, the padded total, and the expert of every row block."""
    e = tl.arange(0, E_P2)
    e_mask = e < num_experts
    counts = tl.load(counts_ptr + e, mask=e_mask, other=0)
    starts = _group_starts(counts, e_mask, expert_ids_ptr, num_padded_ptr, num_experts,
                           num_blocks, BLOCK_M, CHUNK)
    tl.store(starts_ptr + e, starts, mask=e_mask)


@triton.jit(do_not_specialize=["num_slots"])
def _scatter_kernel(ids_ptr, starts_ptr, cursors_ptr, sorted_ids_ptr, num_slots,
                    BLOCK: tl.constexpr):
    """sorted_ids[start[e] + next free row of e] = slot; the order within a group is arbitrary
    (rows of a block are computed independently, and results are written back by slot)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_slots
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    row = tl.atomic_add(cursors_ptr + expert, 1, mask=mask)
    start = tl.load(starts_ptr + expert, mask=mask, other=0)
    tl.store(sorted_ids_ptr + start + row, offs, mask=mask)


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _align_one_program_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                              num_slots, num_experts, num_blocks, BLOCK_M: tl.constexpr,
                              E_P2: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """The three kernels' grouping in one program, for a decode step's few slots: counts by
    one-hot sums, slots in order within their group (a slot's rank: the earlier slots of its
    expert), the padding rows filled first."""
    wait_then_release(USE_PDL)
    e = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], tl.int32)
    for c0 in range(0, num_slots, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
        counts += tl.sum((expert[:, None] == e[None, :]).to(tl.int32), axis=0)
    first = _group_starts(counts, e < num_experts, expert_ids_ptr, num_padded_ptr,
                          num_experts, num_blocks, BLOCK_M, CHUNK)  # next free row of each
    for r0 in range(0, num_blocks * BLOCK_M, CHUNK * BLOCK_M):
        rows = r0 + tl.arange(0, CHUNK * BLOCK_M)
        tl.store(sorted_ids_ptr + rows, num_slots, mask=rows < num_blocks * BLOCK_M)
    tl.debug_barrier()  # every padding row written before the slots land on theirs
    i = tl.arange(0, CHUNK)
    for c0 in range(0, num_slots, CHUNK):
        offs = c0 + i
        mask = offs < num_slots
        expert = tl.load(ids_ptr + offs, mask=mask, other=-1)
        one_hot = (expert[:, None] == e[None, :]).to(tl.int32)
        earlier = (expert[:, None] == expert[None, :]) & (i[None, :] < i[:, None])
        row = tl.sum(one_hot * first[None, :], axis=1) + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ids_ptr + row, offs, mask=mask)
        first += tl.sum(one_hot, axis=0)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_padded): slots grouped by expert, each group padded to
    block_m (see the module docstring); sizes from shapes only. Up to ONE_PROGRAM_SLOTS slots
    one launch, else five (two fills and three kernels)."""
    num_slots = topk_ids.numel()
    # at most min(E, slots) groups, each padded by < block_m rows
    max_padded = num_slots + min(num_experts, num_slots) * (block_m - 1)
    num_blocks = triton.cdiv(max_padded, block_m)
    device, ids = topk_ids.device, topk_ids.reshape(-1)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    groups = dict(BLOCK_M=block_m, E_P2=triton.next_power_of_2(num_experts), CHUNK=32)
    if num_slots <= ONE_PROGRAM_SLOTS:
        sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
        _align_one_program_kernel[(1,)](
            ids, sorted_ids, expert_ids, num_padded, num_slots, num_experts, num_blocks,
            **groups, **launch_options())
        return sorted_ids, expert_ids, num_padded
    counts_cursors_starts = torch.zeros(3, num_experts, dtype=torch.int32, device=device)
    counts, cursors, starts = counts_cursors_starts.unbind(0)
    sorted_ids = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_slots, 256),)
    _count_kernel[grid](ids, counts, num_slots, BLOCK=256)
    _offsets_kernel[(1,)](counts, starts, expert_ids, num_padded, num_experts, num_blocks,
                          **groups)
    _scatter_kernel[grid](ids, starts, cursors, sorted_ids, num_slots, BLOCK=256)
    return sorted_ids, expert_ids, num_padded


def _fp8_inputs(x: torch.Tensor, scale: torch.Tensor | None, group_k: int
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x's codes, their scales, their row stride) for FP8 experts; (x, x, 0) otherwise."""
    if scale is None:
        return x, x, 0
    codes, scales = per_token_group_quant(x, group_k)
    return codes, scales, scales.stride(0)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
              config: MoEConfig | None = None) -> torch.Tensor:
    """sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x), as kernels.moe.reference.

    x [M, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [M, K]. With
    scales (FP8 experts): [E, 2I/bn, H/bk] and [E, H/bn, I/bk] for block (bn, bk), else
    [E, 2I, 1] and [E, H, 1] per channel. config: tiles and launch options (else moe_config's).
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_slots = num_tokens * top_k
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    fp8 = w13_scale is not None
    if config is None:
        config = moe_config(num_slots, num_experts, hidden, inter, fp8, x.element_size())
    # FP8 groups (rows, cols) of each weight's scales; a K step stays inside one group
    g13, g2 = (block, block) if block is not None else ((1, hidden), (1, inter))
    block_k = min(config.block_k, g13[1]) if fp8 else config.block_k
    assert block is None or block[1] % block_k == 0, (block, block_k)
    block_m = config.block_m
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, block_m)
    consts = dict(PRECISION="ieee" if x.dtype == torch.float32 else "tf32", FP8=fp8,
                  BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
                  num_warps=config.num_warps, num_stages=config.num_stages, **launch_options())
    row_blocks = sorted_ids.numel() // block_m
    a, a_scale, stride_as = _fp8_inputs(x, w13_scale, g13[1])
    s13 = w13_scale if fp8 else x
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    _gate_up_silu_kernel[(row_blocks, triton.cdiv(inter, config.block_n))](
        a, w13, h, sorted_ids, expert_ids, num_padded, num_slots, top_k, inter, hidden,
        a.stride(0), w13.stride(0), w13.stride(1), h.stride(0), a_scale, s13, stride_as,
        s13.stride(0) if fp8 else 0, s13.stride(1) if fp8 else 0, g13[0], g13[1], **consts)
    h_in, h_scale, stride_hs = _fp8_inputs(h, w2_scale, g2[1])
    s2 = w2_scale if fp8 else x
    out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(row_blocks, triton.cdiv(hidden, config.block_n))](
        h_in, w2, out, topk_weights.contiguous().flatten(), sorted_ids, expert_ids, num_padded,
        num_slots, hidden, inter, h_in.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        h_scale, s2, stride_hs, s2.stride(0) if fp8 else 0, s2.stride(1) if fp8 else 0,
        g2[0], g2[1], **consts)
    return moe_sum(out, top_k)
