"""Mixture-of-experts reference in plain torch: top-k routing, and a loop over the experts that
received tokens."""
import torch
import torch.nn.functional as F

from nanovllm.kernels.linear.fp8_reference import fp8_linear_torch


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    block: tuple[int, int] | None = None) -> torch.Tensor:
    """sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x): the kernel's reference and the CPU
    path. x [M, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [M, K].
    With scales, w13 and w2 are FP8 codes (kernels.linear.fp8_reference's layout, `block` or per
    channel) and each expert's inputs are quantized as the FP8 kernel does.
    Reads the routed experts on the host, so it cannot be captured in a CUDA graph."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        if w13_scale is None:
            gate, up = F.linear(x[token_idx], w13[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, w2[expert])
        else:
            gate, up = fp8_linear_torch(x[token_idx], w13[expert], w13_scale[expert],
                                        block).chunk(2, dim=-1)
            h = fp8_linear_torch(F.silu(gate) * up, w2[expert], w2_scale[expert], block)
        out.index_add_(0, token_idx, h * topk_weights[token_idx, k_pos, None].to(h.dtype))
    return out


def select_experts_torch(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [M, top_k] of a float32 softmax, renormalised when asked (as transformers)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids
