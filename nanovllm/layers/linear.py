"""Linear layers, sharded for tensor parallelism; each Parameter carries its weight_loader."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.context import get_context


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
    W has nn.Linear's shape [output, input]; with k_major it is stored [input, output] and seen
    through a transposed view (loaders and F.linear are unchanged)."""

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
        self.fused_decode_max_tokens = 0  # bind_backend's: largest step of the fused kernel
        # LoRA (add_lora_slots): per-slot A and B, and the delta op bind_backend chose
        self.register_buffer("lora_a", None, persistent=False)
        self.register_buffer("lora_b", None, persistent=False)
        self.lora_op = None

    def lora_slice_sizes(self) -> tuple[int, ...]:
        """This rank's output features of each fused projection (one unless packed)."""
        return (self.weight.shape[0],)

    def add_lora_slots(self, max_loras: int, max_rank: int) -> None:
        """Zeroed per-slot A [max_loras, slices * max_rank, in] and B [max_loras, out,
        max_rank] (layouts: kernels/lora.py); buffers, so sleep and wake_up move them."""
        out_features, in_features = self.weight.shape
        slices = len(self.lora_slice_sizes())
        self.lora_a = torch.zeros(max_loras, slices * max_rank, in_features,
                                  dtype=self.weight.dtype, device=self.weight.device)
        self.lora_b = torch.zeros(max_loras, out_features, max_rank, dtype=self.weight.dtype,
                                  device=self.weight.device)

    def apply_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus this step's adapter deltas (in place; rows without an adapter unchanged)."""
        mapping = get_context().lora
        if self.lora_op is not None and mapping is not None:
            self.lora_op(y, x, self.lora_a, self.lora_b, self.lora_slice_sizes(), mapping)
        return y

    def fits_fused_decode(self) -> bool:
        """Whether this layer's fused decode kernel takes its shapes (none here: no kernel)."""
        return False

    def runs_fused_decode(self, x: torch.Tensor) -> bool:
        """Whether x's step runs the bound fused kernel: decode, writing the cache, few tokens."""
        if not self.fused_decode_max_tokens:
            return False
        ctx = get_context()
        return not ctx.is_prefill and ctx.slot_mapping is not None \
            and x.shape[0] <= self.fused_decode_max_tokens

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1:
            shard = param.data.size(self.tp_dim)
            loaded_weight = loaded_weight.narrow(self.tp_dim, self.tp_rank * shard, shard)
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_lora(x, F.linear(x, self.weight, self.bias))


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

    def lora_slice_sizes(self) -> tuple[int, ...]:
        return tuple(size // self.tp_size for size in self.output_sizes)

    def fits_fused_decode(self) -> bool:
        """Whether gate_up_silu takes this layer: a gate and an up projection of one size."""
        from nanovllm.kernels.fused_linear import fits_gate_up
        weight, sizes = self.weight, self.output_sizes
        return len(sizes) == 2 and sizes[0] == sizes[1] and weight.is_contiguous() \
            and fits_gate_up(weight.shape[1], weight.shape[0] // 2, weight.dtype)

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        """SiluAndMul()(self(x)) as one kernel, for the steps runs_fused_decode picks."""
        from nanovllm.kernels.fused_linear import gate_up_silu
        return gate_up_silu(x, self.weight, self.bias)

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

    def lora_slice_sizes(self) -> tuple[int, ...]:
        kv_size = self.num_kv_heads * self.head_dim
        return (self.num_heads * self.head_dim, kv_size, kv_size)

    def fits_fused_decode(self) -> bool:
        """Whether qkv_rope_store (Attention.decode_projected) takes this layer's sizes."""
        from nanovllm.kernels.fused_linear import fits_qkv
        weight = self.weight
        return weight.is_contiguous() and fits_qkv(weight.shape[1], self.head_dim, weight.dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size),
                        "v": (q_size + kv_size, kv_size)}[shard_id]
        target = param.data.narrow(0, offset, size)
        target.copy_(loaded_weight.chunk(self.tp_size, 0)[self.tp_rank])


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed by all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        _, tp_size = tp_rank_and_size()
        # k_major: from that layout cuBLAS ran Qwen3-0.6B's o_proj twice as fast below 8 rows
        # on the H200 and tied or won elsewhere (other shapes: docs/benchmarks.md)
        super().__init__(divide(input_size, tp_size), output_size, bias, 1, k_major=True)

    def fits_fused_decode(self) -> bool:
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
        """x W^T (+ b) summed over the ranks: [tokens, output] in x's dtype."""
        # A LoRA delta from this rank's slice of A is partial too: the all-reduce sums it
        y = self.apply_lora(x, F.linear(x, self.weight, self.bias))
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y

    def split_k_partials(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [S, tokens, output] partials over K whose sum over S is x W^T."""
        # For the decode steps runs_fused_decode picks; RMSNorm.add_partials sums them. Split
        # over K: a decode step's few tokens and outputs alone give too few programs.
        from nanovllm.kernels.fused_linear import split_k_linear
        return split_k_linear(x, self.weight)
