"""Inputs of the GEMV and merging tests (test_gemv.py, test_gemv_partials.py,
test_split_k_merge.py): a token's row, a weight in each layout the kernels take, and a decode's
unmerged splits."""
import torch

from nanovllm.kernels.attention.decode_reduce import split_partials
from nanovllm.kernels.attention.pending_merge import PendingMerge
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


def pending_merge(tokens: int, heads: int, splits: int, empty: int, head_dim: int,
                  dtype: torch.dtype) -> PendingMerge:
    """Random softmax partials of `tokens` rows, the last `empty` splits of each empty (as a
    short context leaves them: m = -inf, l = 0, acc = 0); `out` of dtype."""
    part_m, part_l, part_acc = split_partials(tokens, heads, splits, head_dim, DEVICE)
    part_m.copy_(torch.randn_like(part_m) * 4)
    part_l.copy_(torch.rand_like(part_l) + 0.5)
    part_acc.copy_(torch.randn_like(part_acc) * 3)
    part_m[:, :, splits - empty:] = float("-inf")
    part_l[:, :, splits - empty:] = 0.0
    part_acc[:, :, splits - empty:] = 0.0
    out = torch.empty(tokens, heads, head_dim, dtype=dtype, device=DEVICE)
    return PendingMerge(part_m, part_l, part_acc, out)
