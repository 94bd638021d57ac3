"""A per-channel FP8 projection's input, quantized per token by the op before it (no Triton here:
layers hand it on)."""
from typing import NamedTuple

import torch

# Widest row the SiLU-and-mul that writes codes holds in registers at once (one pass a row)
CODES_ROW_MAX = 32768


class TokenCodes(NamedTuple):
    """FP8 codes [M, K] of a projection's input and their float32 scales [M, 1], one a token
    (kernels.linear.fp8_quant.per_token_group_quant's with one group a row), which the RMSNorm
    or SiLU-and-mul before the projection writes instead of its 16-bit output."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The input's shape, [tokens, K] (what a layer asks of x to pick its kernel)."""
        return self.codes.shape
