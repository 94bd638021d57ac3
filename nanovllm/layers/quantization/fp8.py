"""The FP8 weight format of a linear layer (or a stack of experts): its parameters, how checkpoint
tensors load into them, and how bf16 tensors are quantized on the way in.

A layer's `weight` holds float8_e4m3fn codes [N, K] and its scale parameter (named as the
checkpoint names it: `weight_scale_inv` for quant_method "fp8", else `weight_scale`) one float32
per block of `block` (rows, cols), or per output channel ([N, 1]). Tensor parallelism cuts a
scale where it cuts its weight, in units of its block: a shard must start on a block edge, which
FP8Format.check_shards makes an error at construction when it would not.
"""
import torch
from torch import nn

from nanovllm.kernels.linear.fp8_reference import (
    FP8_DTYPE,
    cdiv,
    dequantize_groups,
    quantize_groups,
)
from nanovllm.layers.quantization.config import QuantConfig
from nanovllm.utils.loader import check_shape

# (dst offset, src offset, size) of a shard's rows, or (src offset, size) of its columns, in
# elements of the weight; None: all of them.
Rows = tuple[int, int, int] | None
Cols = tuple[int, int] | None


class Fp8Format:
    """float8_e4m3fn codes with block or per-output-channel float32 scales."""

    def __init__(self, config: QuantConfig):
        self.block = config.weight_block_size  # None: per output channel
        self.scale_name = config.scale_name

    def groups(self, input_size: int) -> tuple[int, int]:
        """(rows, cols) of weight entries one scale covers; a channel's scale covers its row."""
        return self.block if self.block is not None else (1, input_size)

    def check_shards(self, layer: str, output_sizes: list[int], input_size: int,
                     tp_size: int) -> None:
        """Raise ValueError when a shard of this rank's weight would start inside a block."""
        if self.block is None:
            return
        block_n, block_k = self.block
        edges = output_sizes[:-1] if tp_size == 1 else output_sizes
        bad_n = [size for size in edges if size % block_n]
        if bad_n or (tp_size > 1 and input_size % block_k):
            raise ValueError(f"{layer}: FP8 block {list(self.block)} does not divide this rank's "
                             f"output shards {output_sizes} or input size {input_size} "
                             f"(tensor_parallel_size={tp_size}); choose a tensor_parallel_size "
                             f"that keeps shards whole blocks")

    def create_weights(self, module: nn.Module, output_size: int, input_size: int,
                       prefix: str = "", num_experts: int | None = None) -> None:
        """Register `{prefix}weight` (codes) and its scale on module, [E, ...] for experts."""
        group_n, group_k = self.groups(input_size)
        lead = () if num_experts is None else (num_experts,)
        weight = nn.Parameter(torch.empty(*lead, output_size, input_size, dtype=FP8_DTYPE),
                              requires_grad=False)
        scale = nn.Parameter(torch.empty(*lead, cdiv(output_size, group_n),
                                         cdiv(input_size, group_k), dtype=torch.float32),
                             requires_grad=False)
        weight.quant_format, weight.quant_scale = self, scale  # bf16 tensors quantize through
        scale.scale_block = (group_n, group_k if self.block is not None else None)
        module.register_parameter(f"{prefix}weight", weight)
        module.register_parameter(f"{prefix}{self.scale_name}", scale)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of a [N, K] weight in a wider dtype."""
        return quantize_groups(weight, *self.groups(weight.shape[1]))

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """float32 [N, K] of codes and their scales (the weight the model computes with)."""
        return dequantize_groups(codes, scale, *self.groups(codes.shape[1]))


def _narrow(t: torch.Tensor, dim: int, offset: int, size: int, unit: int) -> torch.Tensor:
    """t's slice [offset, offset + size) along dim, in units of `unit` elements (ceil at ends)."""
    return t.narrow(dim, offset // unit, min(cdiv(size, unit), t.shape[dim] - offset // unit))


def load_shard(param: nn.Parameter, loaded: torch.Tensor, rows: Rows, cols: Cols,
               expert: int | None = None) -> None:
    """Copy the (rows, cols) shard of a checkpoint tensor into param (expert's slice of it).

    A scale is cut in units of its block; one per-tensor scale fills its shard's rows; a bf16
    tensor loaded into FP8 codes is quantized here, writing its scales too (quantization at
    load, and update_weights of an FP8 model)."""
    dst = param.data if expert is None else param.data[expert]
    group_n, group_k = getattr(param, "scale_block", (1, 1))
    quant_format = getattr(param, "quant_format", None)
    if quant_format is not None and loaded.dtype != FP8_DTYPE:
        if cols is not None:
            loaded = loaded.narrow(1, *cols)
        if rows is not None:
            dst, loaded = dst.narrow(0, rows[0], rows[2]), loaded.narrow(0, rows[1], rows[2])
        codes, scales = quant_format.quantize(loaded.to(dst.device))
        dst.copy_(codes)
        scale = param.quant_scale.data if expert is None else param.quant_scale.data[expert]
        block_n = quant_format.groups(codes.shape[1])[0]
        offset = 0 if rows is None else rows[0]
        _narrow(scale, 0, offset, codes.shape[0], block_n).copy_(scales)
        return
    if rows is not None:
        dst = _narrow(dst, 0, rows[0], rows[2], group_n)
        if loaded.numel() > 1:
            loaded = _narrow(loaded, 0, rows[1], rows[2], group_n)
    if cols is not None and dst.dim() == 2 and group_k is not None and loaded.numel() > 1:
        loaded = _narrow(loaded, 1, *cols, group_k)
    if hasattr(param, "scale_block"):  # one per-tensor scale fills every row, [N] fills [N, 1]
        if loaded.numel() == 1 and dst.numel() > 1:
            loaded = loaded.reshape(()).expand_as(dst)
        elif loaded.numel() == dst.numel():
            loaded = loaded.reshape(dst.shape)
    check_shape(loaded, dst.shape)  # a weight: exactly this rank's part
    dst.copy_(loaded)
