"""Sparse mixture-of-experts block: a top-k router over stacked experts (Qwen3-MoE).

Experts are stacked into w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; with tensor
parallelism each rank holds a slice of every expert's I (as vLLM), and one all-reduce sums.
With an FP8 weight format both hold FP8 codes beside stacked scales (w13_weight_scale_inv or
w13_weight_scale, [E, ...], cut across ranks with their weights: layers.quantization).
"""
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear, divide, tp_rank_and_size
from nanovllm.layers.quantization.fp8 import Fp8Format, load_shard

# checkpoint names: one tensor (or its FP8 scale) per expert, or (transformers' in-memory form)
# all stacked
_PER_EXPERT = re.compile(
    r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv|weight_scale)$")
_STACKED = re.compile(r"(.*\.experts)\.(gate_up|down)_proj$")
_SHARD_IDS = {"gate": "w1", "up": "w3", "down": "w2", "gate_up": "w13"}


def expert_weight_target(name: str) -> tuple[str, str, int | None] | None:
    """(our parameter, shard id, expert or None for all) of a checkpoint expert tensor name."""
    if m := _PER_EXPERT.match(name):
        prefix, expert, proj, tensor = m.groups()
        return f"{prefix}.{'w2' if proj == 'down' else 'w13'}_{tensor}", _SHARD_IDS[proj], \
            int(expert)
    if m := _STACKED.match(name):
        prefix, proj = m.groups()
        return f"{prefix}.{'w2' if proj == 'down' else 'w13'}_weight", _SHARD_IDS[proj], None
    return None


class FusedMoE(nn.Module):
    """Stacked gated-SiLU experts; `backend` (set by layers.backends.bind_backend) runs them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quant: Fp8Format | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.num_experts = num_experts
        self.intermediate_size = divide(intermediate_size, self.tp_size)  # this rank's slice
        inter = self.intermediate_size
        self.quant = quant
        if quant is None:
            self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
            self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        else:
            quant.check_shards("FusedMoE w13", [inter, inter], hidden_size, self.tp_size)
            quant.check_shards("FusedMoE w2", [hidden_size], inter, self.tp_size)
            quant.create_weights(self, 2 * inter, hidden_size, "w13_", num_experts)
            quant.create_weights(self, hidden_size, inter, "w2_", num_experts)
        for param in self.parameters():
            param.weight_loader = self.weight_loader
        self.backend = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str,
                      expert_id: int | None) -> None:
        """One expert's w1 (gate), w3 (up) or w2 (down), or all experts' w13 or w2 at once."""
        if expert_id is None:
            for expert, weight in enumerate(loaded_weight):
                if shard_id == "w13":
                    gate, up = weight.chunk(2, dim=0)
                    self.weight_loader(param, gate, "w1", expert)
                    self.weight_loader(param, up, "w3", expert)
                else:
                    self.weight_loader(param, weight, shard_id, expert)
            return
        inter, start = self.intermediate_size, self.tp_rank * self.intermediate_size
        if shard_id == "w2":  # [H, I]: this rank's input columns
            load_shard(param, loaded_weight, None, (start, inter), expert_id)
        else:  # gate rows first, then up rows
            offset = 0 if shard_id == "w1" else inter
            load_shard(param, loaded_weight, (offset, start, inter), None, expert_id)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            out = self.backend.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights,
                                         topk_ids)
        else:
            name = self.quant.scale_name
            out = self.backend.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights,
                                         topk_ids, getattr(self, f"w13_{name}"),
                                         getattr(self, f"w2_{name}"), self.quant.block)
        if self.tp_size > 1:
            dist.all_reduce(out)
        return out


class SparseMoeBlock(nn.Module):
    """Router (a replicated linear) + top-k experts; no shared experts (Qwen3-MoE)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool, quant: Fp8Format | None = None):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = ReplicatedLinear(hidden_size, num_experts)  # never quantized (as vLLM)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.gate.weight)  # [M, E]
        weights, ids = self.experts.backend.select_experts(router_logits, self.top_k,
                                                           self.norm_topk_prob)
        return self.experts(x, weights, ids)
