"""Mixture-of-experts reference in plain torch: a loop over the experts that received tokens."""
import torch
import torch.nn.functional as F


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x); the reference the kernel is tested
    against and the CPU path.

    x [M, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [M, K].
    Reads the routed experts on the host, so it cannot be captured in a CUDA graph.
    """
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token_idx], w13[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, token_idx, h * topk_weights[token_idx, k_pos, None].to(h.dtype))
    return out


def moe_align_block_size_torch(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.fused_moe.moe_align_block_size in torch (slots in order within a group): the
    reference its grouping is tested against."""
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
