"""SiLU-and-mul for gated MLPs."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(first half) * second half; `fused` (bound): a Triton kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            # Imported here: CPU-only runs never import Triton (as for the sampler's kernel).
            from nanovllm.kernels.fused_ops import silu_and_mul
            return silu_and_mul(x)
        return self.torch_forward(x)

    @staticmethod
    def torch_forward(x: torch.Tensor) -> torch.Tensor:
        """The torch path (CPU, and the kernel's reference)."""
        x, y = x.chunk(2, -1)
        return F.silu(x) * y
