"""LoRA shrink/expand (Triton) vs the torch reference (TRITON_INTERPRET on CPU)."""
import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.lora import add_lora_triton  # noqa: E402
from nanovllm.kernels.lora_torch import add_lora_torch  # noqa: E402
from nanovllm.runner.step_inputs import group_by_slot, lora_mapping  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# float32 only under the interpreter: Triton 3.8's interpreted tl.dot of bfloat16 tiles returns
# garbage (tests/gpu/test_lora_kernels.py runs bfloat16 on the GPU)
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _case(slots: list[int], k: int, slice_sizes: tuple[int, ...], rank: int, max_loras: int,
          dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = len(slice_sizes)
    x = torch.randn(len(slots), k, generator=g).to(DEVICE, dtype)
    y = torch.randn(len(slots), sum(slice_sizes), generator=g).to(DEVICE, dtype)
    a = torch.randn(max_loras, s * rank, k, generator=g).to(DEVICE, dtype)
    b = (torch.randn(max_loras, sum(slice_sizes), rank, generator=g) * 0.1).to(DEVICE, dtype)
    packed = torch.from_numpy(group_by_slot(np.array(slots), max_loras)).to(DEVICE)
    return x, y, a, b, lora_mapping(packed, len(slots), max_loras)


def test_group_by_slot_orders_rows_by_slot_base_rows_first():
    packed = group_by_slot(np.array([2, -1, 0, 2, 0, -1]), 4)
    rows, counts, starts = packed[:6], packed[6:10], packed[10:]
    assert rows.tolist() == [1, 5, 2, 4, 0, 3]
    assert counts.tolist() == [2, 0, 2, 0] and starts.tolist() == [2, 4, 4, 6]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slice_sizes,rank", [((48,), 8), ((32, 16, 16), 16), ((40, 40), 4)])
def test_triton_matches_the_reference(slice_sizes, rank, dtype):
    # 3 slots with rows, one slot empty, base rows between; more rows than one BLOCK_M tile
    slots = [0, -1, 2, 2, 0, -1, 3] + [2] * 12
    x, y, a, b, mapping = _case(slots, 80, slice_sizes, rank, 4, dtype)
    expected, got = y.clone(), y.clone()
    add_lora_torch(expected, x, a, b, slice_sizes, mapping)
    add_lora_triton(got, x, a, b, slice_sizes, mapping)
    base = [i for i, slot in enumerate(slots) if slot < 0]
    assert torch.equal(got[base], y[base])  # rows without an adapter are untouched
    assert not torch.allclose(expected, y)  # the deltas are not zero: the check has teeth
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol * 10, rtol=tol)


def test_reference_matches_the_lora_formula():
    slots = [1, -1, 0]
    x, y, a, b, mapping = _case(slots, 32, (16, 8), 4, 2, torch.float32)
    got = y.clone()
    add_lora_torch(got, x, a, b, (16, 8), mapping)
    for row, slot in enumerate(slots):
        want = y[row].clone()
        if slot >= 0:
            for s, (lo, hi) in enumerate([(0, 16), (16, 24)]):
                want[lo:hi] += b[slot, lo:hi] @ (a[slot, s * 4:(s + 1) * 4] @ x[row])
        torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4)
