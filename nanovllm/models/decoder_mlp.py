"""The decoder's dense MLP, where a projection's split-K partials meet the norm after them, and
the turns a lone token's one-kernel MLP takes on its model's partial rows."""
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import PendingMerge
from nanovllm.layers.layernorm import PendingNorm, RMSNorm
from nanovllm.layers.linear import RowParallelLinear
from nanovllm.layers.packed_linear import MergedColumnParallelLinear, MlpPartials
from nanovllm.layers.quantization import QuantConfig, linear_format


class DownPartials(NamedTuple):
    """down_proj's split-K partials, computed inside gate_up_proj's kernel (a lone token's)."""

    partials: torch.Tensor


class DecoderMLP(nn.Module):
    """Gated SiLU MLP, gate and up in one GEMM; DecoderLayer runs down_proj (project_add_norm),
    unless a lone token's gate_up kernel ran it too."""

    def __init__(self, config: PretrainedConfig, bias: bool, quant: QuantConfig | None,
                 prefix: str):
        super().__init__()
        gate_up = linear_format(quant, [prefix + "gate_proj", prefix + "up_proj"])
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, quant=gate_up)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=bias,
                                           quant=linear_format(quant, [prefix + "down_proj"]))
        self.act_fn = SiluAndMul()
        self.act_fn.feeds = (self.down_proj,)  # it may take the output as TokenCodes
        # this layer's turn on its model's partial rows for the one-token MLP kernel (MlpTurns;
        # None: never), and whether the last step took it
        self.turn: tuple[MlpPartials, int] | None = None
        self.took_turn = False

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: down_proj's input, [tokens, intermediate_size]."""
        if self.gate_up_proj.runs_fused_decode(x):
            return self.gate_up_proj.gate_up_silu(x)  # SiLU-and-mul in the GEMM's epilogue
        return self.act_fn(self.gate_up_proj(x))

    def add_norm_gated(self, proj: RowParallelLinear, x: torch.Tensor, residual: torch.Tensor,
                       norm: RMSNorm) -> tuple[torch.Tensor | DownPartials, torch.Tensor]:
        """(gated(norm(proj(x) + residual)), or down_proj's DownPartials of it; proj(x) +
        residual)."""
        # A lone token's gate_up GEMV may normalise proj's partials itself (no launch of the
        # norm), and run down_proj too (no launch of down_proj)
        gate_up = self.gate_up_proj
        hidden_states, residual = project_add_norm(proj, x, residual, norm,
                                                   gate_up.runs_norm_gate_up)
        self.took_turn = False
        if not isinstance(hidden_states, PendingNorm):
            return self.gated(hidden_states), residual
        if self.turn is not None and gate_up.runs_norm_gate_up_down(hidden_states, self.down_proj):
            self.took_turn = True
            partials, residual = gate_up.norm_gate_up_down(hidden_states, self.down_proj,
                                                           *self.turn)
            return DownPartials(partials), residual
        return gate_up.norm_gate_up_silu(hidden_states)


def project_add_norm(proj: RowParallelLinear, x: torch.Tensor | PendingMerge,
                     residual: torch.Tensor, norm: RMSNorm,
                     computes_norm: Callable[[PendingNorm], bool] | None = None
                     ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """(norm(proj(x) + residual), proj(x) + residual); the first a PendingNorm if computes_norm."""
    # In the decode steps bound to split-K, norm sums proj's partials (no launch of its own),
    # or the projection norm feeds does, where computes_norm takes their PendingNorm; a
    # PendingMerge is for proj's kernel (attend asked it: takes_pending_merge)
    if not isinstance(x, PendingMerge) and not proj.runs_fused_decode(x):
        return norm(proj(x), residual)
    return add_norm_partials(proj.split_k_partials(x), residual, norm, computes_norm)


def add_norm_partials(partials: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                      computes_norm: Callable[[PendingNorm], bool] | None = None
                      ) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """(norm(sum of partials + residual), that sum), the first a PendingNorm if computes_norm."""
    pending = norm.pending(partials, residual)
    if computes_norm is not None and computes_norm(pending):
        return pending, residual
    return norm.add_partials(pending.partials, residual)


class MlpTurns:
    """The layers' turns on one pair of partial rows of their model (layers.packed_linear's
    MlpPartials): given where every layer is a dense 16-bit MLP and their count is even."""

    def __init__(self, mlps: list[nn.Module]):
        self.mlps = mlps
        self.rows = MlpPartials()
        if len(mlps) % 2 == 0 and all(isinstance(mlp, DecoderMLP) and mlp.gate_up_proj.quant
                                      is None and mlp.down_proj.quant is None for mlp in mlps):
            for i, mlp in enumerate(mlps):
                mlp.turn = (self.rows, i % 2)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Run one forward: rows zeroed again if it stops between layers; a RuntimeError if
        only some layers took their turn (the rows' invariant broke)."""
        try:
            yield
        except BaseException:
            self.rows.reset()
            raise
        took = [mlp.took_turn for mlp in self.mlps if isinstance(mlp, DecoderMLP)]
        if any(took) and not all(took):
            self.rows.reset()
            raise RuntimeError(f"the one-token MLP kernel ran in {sum(took)} of {len(took)} "
                               "layers: every layer or none must take its turn")
