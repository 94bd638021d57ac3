"""Column-parallel projections packing several outputs into one GEMM (gate + up, q + k + v),
with the fused decode kernels that take each packing whole."""
import torch

from nanovllm.kernels.linear.mlp_partials import MlpPartials
from nanovllm.kernels.linear.norm_prologue import PendingNorm
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    tp_rank_and_size,
)
from nanovllm.layers.quantization.fp8 import Cols, Fp8Format, Rows


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one GEMM (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant: Fp8Format | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, quant)

    def local_output_sizes(self, output_size: int) -> list[int]:
        return [size // self.tp_size for size in self.output_sizes]

    def fits_fused_decode(self) -> bool:
        """Whether gate_up_silu takes this layer: a gate and an up projection of one size."""
        from nanovllm.kernels.linear.fused_gate_up import fits_gate_up
        weight, sizes = self.weight, self.output_sizes
        return len(sizes) == 2 and sizes[0] == sizes[1] and weight.is_contiguous() \
            and self.lora_fits_fused() \
            and fits_gate_up(weight.shape[1], weight.shape[0] // 2, *self.fused_format())

    def gate_up_silu(self, x: torch.Tensor) -> torch.Tensor:
        """SiluAndMul()(self(x)) as one kernel, for the steps runs_fused_decode picks."""
        from nanovllm.kernels.linear.fused_gate_up import gate_up_silu
        return gate_up_silu(x, self.weight, self.bias, lora=self.lora_slots(),
                            ahead=self.take_lora_ahead(x), **self.fused_scales())

    def runs_norm_gate_up(self, norm: PendingNorm) -> bool:
        """Whether norm_gate_up_silu runs this step: fused, one token, no LoRA, and a GEMV
        that takes norm's sum of partials and residual (kernels.linear.gemv_gate_up)."""
        from nanovllm.kernels.linear.gemv_gate_up import runs_norm_gate_up_gemv
        return self.runs_fused_decode(norm.residual) and self.lora_slots() is None \
            and runs_norm_gate_up_gemv(norm, self.weight, **self.fused_scales())

    def norm_gate_up_silu(self, norm: PendingNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_silu(h), the sum) for (h, the sum) = norm's add + RMSNorm, the norm
        computed inside the GEMV, for steps runs_norm_gate_up takes."""
        from nanovllm.kernels.linear.gemv_gate_up import norm_gate_up_silu_gemv
        return norm_gate_up_silu_gemv(norm, self.weight, self.bias,
                                      self.fused_scales().get("w_scale"))

    def runs_norm_gate_up_down(self, norm: PendingNorm, down: RowParallelLinear) -> bool:
        """Whether norm_gate_up_down runs this step: runs_norm_gate_up's step, down_proj fused
        in it too, and a kernel that holds both (kernels.linear.gemv_mlp: 16-bit weights in the
        activations' dtype, so no FP8 layer)."""
        from nanovllm.kernels.linear.gemv_mlp import runs_gate_up_down_gemv
        return self.runs_norm_gate_up(norm) \
            and down.runs_fused_decode(norm.residual) and down.lora_slots() is None \
            and runs_gate_up_down_gemv(norm, self.weight, down.weight)

    def norm_gate_up_down(self, norm: PendingNorm, down: RowParallelLinear, rows: MlpPartials,
                          parity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(down's split-K partials of gate_up_silu(h), the sum) for (h, the sum) = norm's add +
        RMSNorm, in one kernel; the layer's turn (parity) on the model's rows (mlp_partials)."""
        from nanovllm.kernels.linear.gemv_mlp import gate_up_down_gemv
        return gate_up_down_gemv(norm, self.weight, self.bias, down.weight, rows, parity)

    def shard(self, shard_id: int) -> tuple[Rows, Cols]:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        return (offset, self.tp_rank * size, size), None


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM; each rank holds its heads of all three."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, quant: Fp8Format | None = None):
        _, tp_size = tp_rank_and_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = divide(total_num_kv_heads, tp_size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias, quant)

    def local_output_sizes(self, output_size: int) -> list[int]:
        kv_size = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv_size, kv_size]

    def fits_fused_decode(self) -> bool:
        """Whether qkv_rope_store (Attention.decode_projected) takes this layer's sizes."""
        from nanovllm.kernels.linear.fused import fits_qkv
        weight = self.weight
        return weight.is_contiguous() and self.lora_fits_fused() \
            and fits_qkv(weight.shape[1], self.head_dim, *self.fused_format())

    def runs_norm_gemv_rows(self, norm: PendingNorm) -> bool:
        """Whether norm_gemv_rows runs this step: a step _takes_gemv_rows for norm's residual,
        and a GEMV that takes norm and the weight (kernels.linear.gemv.runs_norm_gemv_rows)."""
        from nanovllm.kernels.linear.gemv import runs_norm_gemv_rows
        return self._takes_gemv_rows(norm.residual) \
            and runs_norm_gemv_rows(norm, self.weight, **self.fused_scales())

    def norm_gemv_rows(self, norm: PendingNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(gemv_rows(h), the sum) for (h, the sum) = norm's add + RMSNorm, the norm computed
        inside the GEMV, for steps runs_norm_gemv_rows takes."""
        from nanovllm.kernels.linear.gemv import norm_gemv_rows
        return norm_gemv_rows(norm, self.weight, self.bias, self.fused_scales().get("w_scale"))

    def shard(self, shard_id: str) -> tuple[Rows, Cols]:
        q_size, kv_size, _ = self.local_output_sizes(0)
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size),
                        "v": (q_size + kv_size, kv_size)}[shard_id]
        return (offset, self.tp_rank * size, size), None
