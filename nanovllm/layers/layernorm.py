"""RMSNorm, alone or fused with the residual add."""
import torch
from torch import nn

# the add + RMSNorm a one-token GEMV computes first, handed between decoder layers (no Triton)
from nanovllm.kernels.linear.norm_prologue import PendingNorm


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32; with a residual, (normed, x + residual). `fused` (bound
    by layers.backends): a Triton kernel; else the torch methods, the kernels' reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.fused = False
        self.weight = nn.Parameter(torch.ones(hidden_size))
        # (the projection this norm feeds,): a decode step may compute its LoRA shrink here, in
        # the fused kernel (kernels.linear.lora), and a lone token's GEMV of it this norm
        # instead (pending; models.decoder); a tuple, so that it stays registered where it is
        self.feeds: tuple[nn.Module, ...] = ()

    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path: normalise the last dim of x (any leading shape)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    def add_rms_forward(self, x: torch.Tensor,
                        residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: (RMSNorm(x + residual), x + residual), the sum taken in float32."""
        dtype = x.dtype
        x = x.float() + residual.float()
        residual = x.to(dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight, residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            # Imported here: CPU-only runs never import Triton (as for the sampler's kernel).
            from nanovllm.kernels.fused_ops import add_rms_norm, rms_norm
            codes, ahead = self._codes_or_ahead(x.numel() // x.shape[-1])
            if residual is None:
                return self._handed(rms_norm(x, self.weight, self.eps, ahead, codes), ahead)
            return self._handed(add_rms_norm(x, residual, self.weight, self.eps, ahead, codes),
                                ahead)
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)

    def _codes_or_ahead(self, num_tokens: int) -> tuple[bool, tuple | None]:
        """(whether the projection fed takes the normed rows as TokenCodes, else the buffers
        (LoRAAhead) of the shrink it wants computed here)."""
        if not self.feeds:
            return False, None
        if self.feeds[0].wants_token_codes(num_tokens):
            return True, None
        return False, self.feeds[0].lora_ahead_buffers(num_tokens)

    def _handed(self, out: torch.Tensor | tuple, ahead: tuple | None) -> torch.Tensor | tuple:
        """out, after handing the projection fed its shrink of the normed tensor."""
        if ahead is not None:
            self.feeds[0].hand_lora_ahead(out if isinstance(out, torch.Tensor) else out[0],
                                          ahead)
        return out

    def pending(self, partials: torch.Tensor, residual: torch.Tensor) -> PendingNorm:
        """add_partials(partials, residual) left for the projection fed (feeds) to compute."""
        return PendingNorm(partials, residual, self.weight, self.eps)

    def add_partials(self, partials: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """self(x, residual) for x as float32 partials [S, *residual.shape] over K, summed."""
        # The sum is rounded to the residual's dtype, as the GEMM's own output would be.
        if self.fused:
            from nanovllm.kernels.fused_ops import add_partials_rms_norm
            codes, ahead = self._codes_or_ahead(residual.shape[0])
            return self._handed(add_partials_rms_norm(partials, residual, self.weight, self.eps,
                                                      ahead, codes), ahead)
        return self.add_rms_forward(partials.sum(0).to(residual.dtype), residual)
