"""Linear layers, sharded for tensor parallelism; each Parameter carries its weight_loader."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.backends import FUSED_SPLIT_K_MAX_TOKENS, decode_fuses


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and world size (0, 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b); tp_dim is the weight dimension split across ranks (None: replicated).

    W has nn.Linear's shape [output, input]. With k_major it is stored [input, output] and
    seen through a transposed view: loaders and F.linear are unchanged, and cuBLAS runs its
    kernels for the other operand layout."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 k_major: bool = False):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = tp_rank_and_size()
        weight = torch.empty(input_size, output_size).t() if k_major else \
            torch.empty(output_size, input_size)
        self.weight = nn.Parameter(weight)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1:
            shard = param.data.size(self.tp_dim)
            loaded_weight = loaded_weight.narrow(self.tp_dim, self.tp_rank * shard, shard)
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (a MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        _, tp_size = tp_rank_and_size()
        super().__init__(input_size, divide(output_size, tp_size), bias, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one GEMM (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        target.copy_(loaded_weight.chunk(self.tp_size, 0)[self.tp_rank])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM; each rank holds its heads of all three."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        _, tp_size = tp_rank_and_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = divide(total_num_kv_heads, tp_size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size),
                        "v": (q_size + kv_size, kv_size)}[shard_id]
        target = param.data.narrow(0, offset, size)
        target.copy_(loaded_weight.chunk(self.tp_size, 0)[self.tp_rank])


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed by all-reduce.

    With `split_k` (set by layers.backends.bind_backend) a decode step returns float32 split-K
    partials [S, tokens, output] instead (kernels.fused_linear.split_k_linear), which the add +
    RMSNorm that follows every o_proj and down_proj sums (DecoderLayer)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        _, tp_size = tp_rank_and_size()
        # k_major: from that layout cuBLAS ran Qwen3-0.6B's o_proj twice as fast below 8 rows
        # on the H200 and tied or won elsewhere (other shapes: docs/benchmarks.md)
        super().__init__(divide(input_size, tp_size), output_size, bias, 1, k_major=True)
        self.split_k = False

    def can_split_k(self) -> bool:
        """Whether split_k_linear takes this layer: one rank, no bias, the k-major weight."""
        from nanovllm.kernels.fused_linear import fits_split_k
        weight = self.weight
        return self.tp_size == 1 and self.bias is None and weight.t().is_contiguous() \
            and fits_split_k(weight.shape[1], weight.shape[0], weight.dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is added once, on rank 0 only
            param.data.copy_(loaded_weight if self.tp_rank == 0 else 0 * loaded_weight)
            return
        super().weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_k and decode_fuses(x.shape[0], FUSED_SPLIT_K_MAX_TOKENS):
            from nanovllm.kernels.fused_linear import split_k_linear
            return split_k_linear(x, self.weight)
        y = F.linear(x, self.weight, self.bias)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
