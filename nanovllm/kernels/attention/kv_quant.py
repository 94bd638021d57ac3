"""FP8 KV cache quantization in plain torch: the reference the Triton kernels match.

An FP8 cache (float8_e4m3fn) holds x / scale, saturated to +-448, with one float32 scale per
attention layer for K and one for V; every reader multiplies by the scale again.
"""
import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_kv_torch(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache dtype; for FP8 exactly as the kernels' `quantize_kv`: x * (1 / scale) in
    float32 (the reciprocal rounded once), saturated, rounded to e4m3."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    inv_scale = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv_torch(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache rows as float32 values: FP8 rows times their scale; others unchanged."""
    if x.dtype != FP8_DTYPE:
        return x.float()
    return x.float() * torch.tensor(scale, dtype=torch.float32, device=x.device)
