"""Inputs of the one-token GEMV tests (test_gemv.py, test_gemv_partials.py): a token's row and a
weight in each layout the kernels take."""
import torch

from nanovllm.kernels.linear.fp8_reference import dequantize_groups, quantize_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16]


def token_row(size: int, dtype: torch.dtype) -> torch.Tensor:
    """One token's activations [1, size]."""
    return (torch.randn(1, size, device=DEVICE) * 2).to(dtype)


def gemv_weight(rows: int, cols: int, fmt: str, dtype: torch.dtype):
    """(weight as the kernel takes it, its scales or None, the float32 weight it stands for)."""
    w = torch.randn(rows, cols, device=DEVICE) * cols ** -0.5
    if fmt == "fp8":
        codes, scales = quantize_groups(w, 1, cols)
        return codes, scales, dequantize_groups(codes, scales, 1, cols)
    w = w.to(dtype)
    if fmt == "k-major":  # RowParallelLinear keeps [K, N] and sees it transposed
        return w.t().contiguous().t(), None, w.float()
    return w, None, w.float()
