"""Fused mixture-of-experts in Triton: tokens grouped by expert, two grouped GEMMs, top-k sum.

Each (token, k) pair is a "slot" (M * K of them). Slots are sorted by expert and each expert's
group is padded to a multiple of BLOCK_M, so every row block of the grouped GEMMs belongs to
one expert:

    sorted_ids:  [e0 e0 e0 pad | e2 e2 pad pad | e5 ...]   (slot ids; pad = M * K)
    expert_ids:  [    e0       |      e2       |  e5 ...]   (one per BLOCK_M rows)

The padded length is bounded from shapes alone, and the grouping uses only device ops, so a
decode step has no host sync and can be captured in a CUDA graph; blocks past the real padded
length (num_padded, on the device) return at once.
"""
import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _row_block(sorted_ids_ptr, num_padded_ptr, num_slots, BLOCK_M: tl.constexpr):
    """This program's slots, their mask, and whether the block holds any rows at all."""
    pid_m = tl.program_id(0)
    live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return slots, slots < num_slots, live


@triton.jit
def _gate_up_silu_kernel(x_ptr, w13_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                         num_slots, top_k, N, K, stride_xm, stride_we, stride_wn, stride_hm,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """h[slot, n] = silu(x[token] . w1[e, n]) * (x[token] . w3[e, n]) for one row/column tile."""
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
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k + k0 < K
            a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            g = tl.load(g_ptrs + k0, mask=w_mask, other=0.0)
            u = tl.load(u_ptrs + k0, mask=w_mask, other=0.0)
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        h_ptrs = h_ptr + slots[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                 num_padded_ptr, num_slots, N, K, stride_hm, stride_we, stride_wn, stride_om,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """out[slot, n] = topk_weight[slot] * (h[slot] . w2[e, n]) for one row/column tile."""
    slots, row_mask, live = _row_block(sorted_ids_ptr, num_padded_ptr, num_slots, BLOCK_M)
    if live:
        expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
        rows = slots.to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :]
        b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k + k0 < K
            a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * weight[:, None].to(tl.float32)
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & n_mask[None, :])


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows per block: small when each expert gets few slots (decode), to waste little padding."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_padded): slots grouped by expert, each group padded to
    block_m (see the module docstring); device ops only, sizes from shapes only."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    # at most min(E, slots) groups, each padded by < block_m rows
    max_padded = num_slots + min(num_experts, num_slots) * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_slots, device=flat.device) - (torch.cumsum(counts, 0) - counts)[
        sorted_experts]
    sorted_ids = torch.full((max_padded,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, padded_start[sorted_experts] + rank, order.int())
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).int()  # blocks past the end: unused
    return sorted_ids, expert_ids, padded_end[-1:].int()


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x), as kernels.fused_moe_torch.

    x [M, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [M, K].
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_slots = num_tokens * top_k
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    block_m = block_m_for(num_slots, num_experts)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, block_m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    grid = (sorted_ids.numel() // block_m, triton.cdiv(inter, BLOCK_N))
    _gate_up_silu_kernel[grid](
        x, w13, h, sorted_ids, expert_ids, num_padded, num_slots, top_k, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    grid = (sorted_ids.numel() // block_m, triton.cdiv(hidden, BLOCK_N))
    _down_kernel[grid](
        h, w2, out, topk_weights.contiguous().flatten(), sorted_ids, expert_ids, num_padded,
        num_slots, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
