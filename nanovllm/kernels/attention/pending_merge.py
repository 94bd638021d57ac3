"""A decode's output left unmerged for the o_proj kernel after it: a lone token's GEMV
(decode_reduce.merged_heads, kernels.linear.gemv_partials) or 2-16 tokens' split-K
(decode_reduce.merged_rows, kernels.linear.split_k). No Triton here: layers hand it on."""
from typing import NamedTuple

import torch


class PendingMerge(NamedTuple):
    """A decode's output, left as its splits' softmax partials (split_partials') for the
    kernel that reads it to merge; `out` [B, H, D] is where a merge launch would write it, never
    written on this path (its dtype: the rounding)."""

    part_m: torch.Tensor
    part_l: torch.Tensor
    part_acc: torch.Tensor
    out: torch.Tensor
