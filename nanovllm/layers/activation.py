"""SiLU-and-mul for gated MLPs."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.linear.token_codes import CODES_ROW_MAX, TokenCodes


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(first half) * second half; `fused` (bound): a Triton kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False
        # (the projection this feeds,): it may take the output as per-token FP8 codes
        self.feeds: tuple[nn.Module, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor | TokenCodes:
        if self.fused:
            # Imported here: CPU-only runs never import Triton (as for the sampler's kernel).
            from nanovllm.kernels.fused_ops import silu_and_mul, silu_and_mul_codes
            if self.feeds and x.shape[-1] // 2 <= CODES_ROW_MAX \
                    and self.feeds[0].wants_token_codes(x.numel() // x.shape[-1]):
                return silu_and_mul_codes(x)
            return silu_and_mul(x)
        return self.torch_forward(x)

    @staticmethod
    def torch_forward(x: torch.Tensor) -> torch.Tensor:
        """The torch path (CPU, and the kernel's reference)."""
        x, y = x.chunk(2, -1)
        return F.silu(x) * y
