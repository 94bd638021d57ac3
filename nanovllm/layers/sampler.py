"""Token sampling without host syncs: Gumbel-max race for temperature rows, argmax for greedy."""
import torch
from torch import nn

from nanovllm.utils.compile import compile_on_cuda


class Sampler(nn.Module):
    """logits [B, V], temperatures [B] (0 = greedy) -> token ids [B]."""

    @compile_on_cuda
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        scaled = logits / temperatures.clamp(min=1e-5).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        # argmax(p / E) with E ~ Exp(1) draws from p: the exponential race.
        noise = torch.empty_like(probs).exponential_(1).clamp_(min=1e-10)
        sampled = probs.div_(noise).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)
