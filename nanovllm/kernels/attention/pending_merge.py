"""A lone token's decode output left unmerged for the GEMV after it (decode_reduce.merged_heads
merges it there, kernels.linear.gemv_partials). No Triton here: layers hand it on."""
from typing import NamedTuple

import torch


class PendingMerge(NamedTuple):
    """A one-token decode's output, left as its splits' softmax partials (split_partials') for
    the GEMV that reads it to merge (kernels.linear.gemv_partials); `out` [1, H, D] is where a
    merge launch would write it, never written on this path (its dtype: the rounding)."""

    part_m: torch.Tensor
    part_l: torch.Tensor
    part_acc: torch.Tensor
    out: torch.Tensor
