"""LoRA shrink (Triton) vs the torch reference, and the reference vs the LoRA formula
(TRITON_INTERPRET on CPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.linear.lora import lora_shrink  # noqa: E402
from nanovllm.kernels.linear.lora_reference import lora_expand, lora_shrink_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.bfloat16]


def lora_case(slots: list[int], k: int, slice_sizes: tuple[int, ...], rank: int,
              max_loras: int, dtype: torch.dtype, seed: int = 0):
    """(x, y, lora_a [S, L, R, K], lora_b [OUT, L, R], slots) of random values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), k, generator=g).to(DEVICE, dtype)
    y = torch.randn(len(slots), sum(slice_sizes), generator=g).to(DEVICE, dtype)
    a = torch.randn(len(slice_sizes), max_loras, rank, k, generator=g).to(DEVICE, dtype)
    b = (torch.randn(sum(slice_sizes), max_loras, rank, generator=g) * 0.1).to(DEVICE, dtype)
    return x, y, a, b, torch.tensor(slots, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slice_sizes,rank", [((48,), 8), ((32, 16, 16), 16), ((40, 40), 4)])
@pytest.mark.parametrize("num_rows", [7, 19, 70])  # decode and prefill tiles
def test_triton_shrink_matches_the_reference(slice_sizes, rank, num_rows, dtype):
    # 3 of 4 slots with rows, one slot empty, base rows between
    slots = ([0, -1, 2, 2, 0, -1, 3] * 10)[:num_rows]
    x, _, a, _, slot_t = lora_case(slots, 160, slice_sizes, rank, 4, dtype)
    want = lora_shrink_torch(x, a, slot_t)
    got = lora_shrink(x, a, slot_t)
    assert got.dtype == dtype and got.shape == want.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 10, rtol=tol)
    assert got[[i for i, s in enumerate(slots) if s < 0]].abs().sum() == 0  # base rows
    assert want.abs().sum() > 0  # the check has teeth


def test_shrink_of_base_rows_only_is_zero():
    x, _, a, _, slot_t = lora_case([-1] * 20, 64, (32,), 8, 2, torch.float32)
    assert lora_shrink(x, a, slot_t).abs().sum() == 0


def test_reference_matches_the_lora_formula():
    slots = [1, -1, 0]
    x, y, a, b, slot_t = lora_case(slots, 32, (16, 8), 4, 2, torch.float32)
    got = lora_expand(y.clone(), lora_shrink_torch(x, a, slot_t), b, (16, 8))
    for row, slot in enumerate(slots):
        want = y[row].clone()
        if slot >= 0:
            for s, (lo, hi) in enumerate([(0, 16), (16, 24)]):
                want[lo:hi] += b[lo:hi, slot] @ (a[s, slot] @ x[row])
        torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4)
