"""RMSNorm, alone or fused with the residual add."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32; with a residual, (normed, x + residual). `fused` (bound
    by layers.backends): a Triton kernel; else the torch methods, the kernels' reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.fused = False
        self.weight = nn.Parameter(torch.ones(hidden_size))
        # (the projection this norm feeds,): its LoRA shrink (kernels.linear.lora) or its FP8
        # input codes may be computed here; a tuple, so that it stays registered where it is
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
            num_tokens = x.numel() // x.shape[-1]
            ahead, codes = self._lora_ahead(num_tokens), self._codes(num_tokens, x.device)
            if residual is None:
                out = rms_norm(x, self.weight, self.eps, ahead, codes)
            else:
                out = add_rms_norm(x, residual, self.weight, self.eps, ahead, codes)
            return self._handed(out, ahead, codes)
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)

    def _lora_ahead(self, num_tokens: int) -> tuple | None:
        """The buffers (LoRAAhead) of the shrink the projection fed wants computed here."""
        return self.feeds[0].lora_ahead_buffers(num_tokens) if self.feeds else None

    def _codes(self, num_tokens: int, device: torch.device) -> tuple | None:
        """Buffers for the normed rows' per-token FP8 codes, when the projection fed wants
        them (LinearBase.wants_token_codes); else None."""
        if not self.feeds or not self.feeds[0].wants_token_codes(num_tokens):
            return None
        from nanovllm.kernels.fused_ops import token_codes
        return token_codes(num_tokens, self.weight.shape[0], device)

    def _handed(self, out: torch.Tensor | tuple, ahead: tuple | None,
                codes: tuple | None = None) -> torch.Tensor | tuple:
        """out, after handing the projection fed its shrink of the normed tensor, or codes."""
        normed = out if isinstance(out, torch.Tensor) else out[0]
        if ahead is not None:
            self.feeds[0].hand_lora_ahead(normed, ahead)
        if codes is not None:
            self.feeds[0].hand_token_codes(normed, codes)
        return out

    def add_partials(self, partials: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """self(x, residual) for x as float32 partials [S, *residual.shape] over K, summed."""
        # The sum is rounded to the residual's dtype, as the GEMM's own output would be.
        if self.fused:
            from nanovllm.kernels.fused_ops import add_partials_rms_norm
            ahead = self._lora_ahead(residual.shape[0])
            codes = self._codes(residual.shape[0], residual.device)
            return self._handed(add_partials_rms_norm(partials, residual, self.weight, self.eps,
                                                      ahead, codes), ahead, codes)
        return self.add_rms_forward(partials.sum(0).to(residual.dtype), residual)
