"""W8A8 FP8 linear layers in plain torch: the reference the Triton kernels match, and the CPU path.

A weight W [N, K] is stored as float8_e4m3fn codes with float32 scales, one per (gn x gk) block:

    W[n, k] = codes[n, k] * scale[n // gn, k // gk]     block (128, 128): scale [N/128, K/128]
                                                        per channel (1, K): scale [N, 1]

Activations are quantized dynamically, per token in groups of gk (per token when gk = K), with
scale = max|x| / 448 over the group; the GEMM sums codes x codes times both scales. This module
simulates that exactly: quantize, dequantize, multiply in float32.
"""
import torch
import torch.nn.functional as F

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE, FP8_MAX

SCALE_EPS = 1e-10  # an all-zero group gets this amax, not a zero scale


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_groups(x: torch.Tensor, group_n: int, group_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K] float8, scales [ceil(N/gn), ceil(K/gk)] float32) of a 2-D tensor; edge
    blocks are partial (ceil)."""
    n, k = x.shape
    gn, gk = min(group_n, n), min(group_k, k)
    rows, cols = cdiv(n, gn), cdiv(k, gk)
    padded = F.pad(x.float(), (0, cols * gk - k, 0, rows * gn - n))
    blocks = padded.view(rows, gn, cols, gk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=SCALE_EPS) / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.view(rows * gn, cols * gk)[:n, :k].contiguous(), scale


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, group_n: int,
                      group_k: int) -> torch.Tensor:
    """float32 values of codes [N, K] with scales [ceil(N/gn), ceil(K/gk)] (or one scale)."""
    n, k = codes.shape
    full = scale.float().reshape(-1, 1) if scale.numel() == 1 else scale.float()
    full = full.repeat_interleave(group_n, 0)[:n] if full.shape[0] > 1 else full
    full = full.repeat_interleave(group_k, 1)[:, :k] if full.shape[1] > 1 else full
    return codes.float() * full


def per_token_group_quant_torch(x: torch.Tensor, group: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (codes [M, K] float8, scales [M, ceil(K/group)] float32)."""
    return quantize_groups(x, 1, group)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int] | None, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x W^T (+ b) in x's dtype, with x quantized per token group as the kernels do.

    weight [N, K] float8; weight_scale [ceil(N/bn), ceil(K/bk)] for block (bn, bk), else [N, 1].
    """
    k = weight.shape[1]
    group_n, group_k = block if block is not None else (1, k)
    x2 = x.reshape(-1, k)
    codes, scales = per_token_group_quant_torch(x2, group_k)
    a = dequantize_groups(codes, scales, 1, group_k)
    b = dequantize_groups(weight, weight_scale, group_n, group_k)
    y = a @ b.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
