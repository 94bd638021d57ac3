"""The add + RMSNorm a one-token GEMV may compute first, from the split-K partials of the
projection before it (o_proj's before gate_up_proj, down_proj's before the next layer's
qkv_proj): every program sums and normalises the row itself (kernels.linear.gemv.gemv_input),
so the norm needs no launch of its own. No Triton here: the decoder hands a PendingNorm from
one layer to the next.
"""
from typing import NamedTuple

import torch

MAX_PARTIALS = 64  # the most splits a GEMV leaves (the norm after sums them in one program)
PARTIAL_BYTES = 4  # split-K partials are float32


class PendingNorm(NamedTuple):
    """x = RMSNorm(sum of `partials` [S, 1, K] + residual), which the GEMV fed computes first."""

    partials: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


def takes_norm(norm: PendingNorm) -> bool:
    """Whether the GEMV kernels take norm's partials, residual and weight (as add_partials')."""
    # at most MAX_PARTIALS contiguous float32 partials of the residual's row, and a contiguous
    # norm weight of its dtype and width
    partials, residual, weight, _ = norm
    return partials.dtype == torch.float32 and partials.is_contiguous() \
        and partials.shape[1:] == residual.shape and partials.shape[0] <= MAX_PARTIALS \
        and weight.shape == residual.shape[1:] and weight.dtype == residual.dtype \
        and weight.is_contiguous()


def cheap_enough(norm: PendingNorm, programs: int, weight: torch.Tensor) -> bool:
    """Whether `programs` programs' reads of all norm's partials stay within half the weight."""
    # The partials come from L2, the weight from HBM. From shapes only (the same answer in a
    # CUDA graph's capture and replay): a first bound from bytes, for a measurement on the GPU
    # to replace. Qwen3-0.6B: gate_up's 384 programs read o_proj's 4 partials, 6 of its 12 MB;
    # qkv_proj's 128 (whole rows of NORM_ROWS_ELEMENTS) read down_proj's 6, 3 of its 8 MB
    # (bf16), or its 3, 1.5 of 4 MB (FP8 per channel). Llama-3.1-8B bf16's would read
    # down_proj's 28 seven times over its weight: refused.
    return programs * norm.partials.numel() * PARTIAL_BYTES \
        <= weight.numel() * weight.element_size() // 2


def prologue_args(x: torch.Tensor | None, norm: PendingNorm | None
                  ) -> tuple[torch.Tensor, tuple, torch.Tensor | None, int]:
    """(x_ptr; res_ptr, norm_w_ptr, res_out_ptr, eps; the sum's output or None; PARTIALS)."""
    # x_ptr is x, or norm's partials; without a norm its pointers are x's (never read)
    if norm is None:
        return x, (x, x, x, 0.0), None, 0
    res_out = torch.empty_like(norm.residual)
    return norm.partials, (norm.residual, norm.weight, res_out, norm.eps), res_out, \
        norm.partials.shape[0]
