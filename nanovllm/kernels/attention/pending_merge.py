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
    # How the decode spread a lone token's keys over the splits (decode._split_bounds), so that
    # a merge knows which hold a key from the step's inputs, before its PDL wait; None: it
    # finds them from the splits' maxima after the wait
    context_lens: torch.Tensor | None = None
    window: int = 0  # a sliding window's keys (0: none)
    block_n: int = 0  # keys per tile
