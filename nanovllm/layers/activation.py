"""SiLU-and-mul for gated MLPs."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compile_on_cuda


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(first half) * second half, [..., d]."""

    @compile_on_cuda
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, y = x.chunk(2, -1)
        return F.silu(x) * y
