"""Linear layers, sharded for tensor parallelism; each Parameter carries its weight_loader."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.attention.pending_merge import PendingMerge
from nanovllm.kernels.linear.token_codes import TokenCodes
from nanovllm.layers.lora_slots import LoRASlots
from nanovllm.layers.quantization.fp8 import Cols, Fp8Format, Rows, load_shard
from nanovllm.utils.context import get_context
from nanovllm.utils.loader import check_shape


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and world size (0, 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(LoRASlots, nn.Module):
    """y = x W^T (+ b); tp_dim is the weight dimension split across ranks (None: replicated).
    W has nn.Linear's shape [output, input]; with k_major it is stored [input, output] and seen
    through a transposed view (loaders and F.linear are unchanged). With a weight format `quant`
    W holds FP8 codes beside their scales (layers.quantization) and `fp8_linear`, bound by
    layers.backends.bind_backend, computes y; the fused decode kernels take the codes too."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 k_major: bool = False, quant: Fp8Format | None = None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.quant = quant
        self.fp8_linear = None  # bind_backend's, for a quantized layer
        # bind_backend's: (tokens, block) -> whether fp8_linear takes that step's TokenCodes
        self.fp8_takes_codes = None
        # the model dtype it is built in: an FP8 layer's activations (its weight holds codes)
        self.act_dtype = torch.get_default_dtype()
        if quant is not None:
            quant.check_shards(type(self).__name__, self.local_output_sizes(output_size),
                               input_size, self.tp_size)
            quant.create_weights(self, output_size, input_size)
        else:
            weight = torch.empty(input_size, output_size).t() if k_major else \
                torch.empty(output_size, input_size)
            self.weight = nn.Parameter(weight)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
        self.fused_decode = False  # bind_backend's: bound to the fused decode kernels
        self.fused_decode_max_tokens = 0  # bind_backend's: largest step of the fused kernel
        self.init_lora_slots()

    def local_output_sizes(self, output_size: int) -> list[int]:
        """This rank's output rows of each fused projection (one: not fused)."""
        return [output_size]

    def fits_fused_decode(self) -> bool:
        """Whether this layer's fused decode kernel takes its shapes (none here: no kernel)."""
        return False

    def fused_format(self) -> tuple[torch.dtype, torch.dtype, tuple[int, int] | None]:
        """(activation dtype, weight dtype, FP8 scale block) as kernels.linear.fused's fits_*
        take them; a 16-bit layer's activations are in its weight's dtype."""
        if self.quant is None:
            return self.weight.dtype, self.weight.dtype, None
        return self.act_dtype, self.weight.dtype, self.quant.block

    def fused_scales(self) -> dict:
        """The fused decode kernels' FP8 keywords: the weight's scales and their block (none
        for a 16-bit weight)."""
        if self.quant is None:
            return {}
        return {"w_scale": getattr(self, self.quant.scale_name), "w_block": self.quant.block}

    def runs_fused_decode(self, x: torch.Tensor | TokenCodes) -> bool:
        """Whether x's step runs the bound fused kernel: decode, writing the cache, few tokens."""
        return self._fuses_step(x.shape[0])

    def _fuses_step(self, num_tokens: int) -> bool:
        """runs_fused_decode for a step of num_tokens."""
        if not self.fused_decode_max_tokens:
            return False
        ctx = get_context()
        return not ctx.is_prefill and ctx.slot_mapping is not None \
            and num_tokens <= self.fused_decode_max_tokens

    def wants_token_codes(self, num_tokens: int) -> bool:
        """Whether the norm or SiLU-and-mul before should hand this layer its input as
        TokenCodes (no quantization launch of its own): an FP8 GEMM that takes them for this
        step, which runs no fused decode kernel and no LoRA."""
        return self.fp8_takes_codes is not None and self.lora_slots() is None \
            and self.fp8_takes_codes(num_tokens, self.quant.block) \
            and not self._fuses_step(num_tokens)

    def runs_gemv_rows(self, x: torch.Tensor) -> bool:
        """Whether gemv_rows takes x: a step _takes_gemv_rows, a weight the whole-row GEMV
        takes (kernels.linear.gemv)."""
        from nanovllm.kernels.linear.gemv import runs_gemv_rows
        return self._takes_gemv_rows(x) and runs_gemv_rows(x, self.weight, **self.fused_scales())

    def _takes_gemv_rows(self, x: torch.Tensor) -> bool:
        """Whether x is one token of a decode step writing the cache, on a layer bound to the
        fused kernels (at any measured limit: one token runs a GEMV either way), no LoRA."""
        ctx = get_context()
        return x.shape[0] == 1 and self.fused_decode and not ctx.is_prefill \
            and ctx.slot_mapping is not None and self.lora_slots() is None

    def gemv_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ bias), [1, out], as whole-row GEMVs, for a step runs_gemv_rows takes."""
        from nanovllm.kernels.linear.gemv import gemv_rows
        return gemv_rows(x, self.weight, self.bias, self.fused_scales().get("w_scale"))

    def shard(self, *shard_id) -> tuple[Rows, Cols]:
        """Where this rank's part of a checkpoint tensor lies and lands (load_shard's ranges)."""
        if self.tp_size == 1 or self.tp_dim is None:
            return None, None
        if self.tp_dim == 0:
            rows = self.weight.shape[0]
            return (0, self.tp_rank * rows, rows), None
        cols = self.weight.shape[1]
        return None, (self.tp_rank * cols, cols)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, *shard_id) -> None:
        rows, cols = self.shard(*shard_id)
        if self.tp_size == 1 and rows is not None and not hasattr(param, "scale_block"):
            # one rank takes a packed module's rows whole: more rows is a wrong tensor
            check_shape(loaded_weight, (rows[2], *param.shape[1:]))
        load_shard(param, loaded_weight, rows, cols)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) in x's dtype, through the FP8 GEMM when the weight is quantized."""
        if self.quant is None:
            return F.linear(x, self.weight, bias)
        scale = getattr(self, self.quant.scale_name)
        if isinstance(x, TokenCodes):  # the op before quantized x (wants_token_codes)
            return self.fp8_linear(x, self.weight, scale, self.quant.block, bias,
                                   out_dtype=self.act_dtype)
        return self.fp8_linear(x, self.weight, scale, self.quant.block, bias)

    def forward(self, x: torch.Tensor | TokenCodes) -> torch.Tensor:
        return self.apply_lora(x, self.linear(x, self.bias))


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (a MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant: Fp8Format | None = None):
        super().__init__(input_size, output_size, bias, None, quant=quant)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant: Fp8Format | None = None):
        _, tp_size = tp_rank_and_size()
        super().__init__(input_size, divide(output_size, tp_size), bias, 0, quant=quant)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed by all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant: Fp8Format | None = None):
        _, tp_size = tp_rank_and_size()
        # k_major: from that layout cuBLAS ran Qwen3-0.6B's o_proj twice as fast below 8 rows
        # on the H200 and tied or won elsewhere (other shapes: docs/design.md); FP8 codes
        # stay [output, input], the layout the FP8 GEMMs read
        super().__init__(divide(input_size, tp_size), output_size, bias, 1,
                         k_major=quant is None, quant=quant)

    def fits_fused_decode(self) -> bool:
        """Whether split_k_linear takes this layer: one rank, no bias, the weight as stored
        (16-bit: k-major; FP8 codes: [output, input])."""
        from nanovllm.kernels.linear.split_k import fits_split_k
        weight = self.weight
        stored = weight.t() if self.quant is None else weight
        return self.tp_size == 1 and self.bias is None and stored.is_contiguous() \
            and self.lora_fits_fused() \
            and fits_split_k(weight.shape[1], weight.shape[0], *self.fused_format())

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param is self.bias:  # the bias is added once, on rank 0 only
            param.data.copy_(loaded_weight if self.tp_rank == 0 else 0 * loaded_weight)
            return
        super().weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor | TokenCodes) -> torch.Tensor:
        """x W^T (+ b) summed over the ranks: [tokens, output] in x's dtype."""
        # A LoRA delta from this rank's slice of A is partial too: the all-reduce sums it
        y = self.apply_lora(x, self.linear(x, self.bias))
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y

    def takes_pending_merge(self, x: torch.Tensor, head_dim: int) -> bool:
        """Whether split_k_partials takes the PendingMerge of x's decode attention (x: rows of
        its tokens, heads of head_dim): a step runs_fused_decode takes, no LoRA, and a kernel
        whose programs take whole heads (a lone token's GEMV: gemv_partials.runs_merge_gemv;
        2-16 tokens: split_k.runs_merge_split_k)."""
        from nanovllm.kernels.linear.gemv_partials import runs_merge_gemv
        from nanovllm.kernels.linear.split_k import runs_merge_split_k
        if not self.runs_fused_decode(x) or self.lora_slots() is not None:
            return False
        dtype = self.fused_format()[0]
        if x.shape[0] == 1:
            return runs_merge_gemv(dtype, head_dim, self.weight, **self.fused_scales())
        return runs_merge_split_k(x.shape[0], dtype, head_dim, self.weight,
                                  self.fused_scales().get("w_block"))

    def split_k_partials(self, x: torch.Tensor | PendingMerge) -> torch.Tensor:
        """float32 [S, tokens, output] partials over K whose sum over S is x W^T; x may be a
        decode's PendingMerge, for steps takes_pending_merge takes."""
        # For the decode steps runs_fused_decode picks; RMSNorm.add_partials sums them. Split
        # over K: a decode step's few tokens and outputs alone give too few programs.
        from nanovllm.kernels.linear.split_k import split_k_linear
        return split_k_linear(x, self.weight, lora=self.lora_slots(), **self.fused_scales())
