"""Mixture-of-experts reference in plain torch: a loop over the experts that received tokens."""
import torch
import torch.nn.functional as F


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x): the kernel's reference and the CPU
    path. x [M, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [M, K].
    Reads the routed experts on the host, so it cannot be captured in a CUDA graph."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token_idx], w13[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, token_idx, h * topk_weights[token_idx, k_pos, None].to(h.dtype))
    return out

