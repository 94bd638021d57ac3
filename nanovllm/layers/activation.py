"""SiLU-and-mul for gated MLPs."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(first half) * second half; `fused` (bound): a Triton kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False
        # (the projection this feeds,): its per-token FP8 input codes may be computed here
        self.feeds: tuple[nn.Module, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            # Imported here: CPU-only runs never import Triton (as for the sampler's kernel).
            from nanovllm.kernels.fused_ops import silu_and_mul, token_codes
            num_tokens = x.numel() // x.shape[-1]
            if not self.feeds or not self.feeds[0].wants_token_codes(num_tokens):
                return silu_and_mul(x)
            codes = token_codes(num_tokens, x.shape[-1] // 2, x.device)
            out = silu_and_mul(x, codes)
            self.feeds[0].hand_token_codes(out, codes)
            return out
        return self.torch_forward(x)

    @staticmethod
    def torch_forward(x: torch.Tensor) -> torch.Tensor:
        """The torch path (CPU, and the kernel's reference)."""
        x, y = x.chunk(2, -1)
        return F.silu(x) * y
