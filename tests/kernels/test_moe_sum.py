"""The experts' top-k sum kernel against torch's sum over k (TRITON_INTERPRET on CPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.moe.moe_sum import moe_sum  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,top_k,hidden,dtype", [
    (1, 8, 2048, torch.bfloat16),   # Qwen3-30B-A3B at batch 1: two column blocks
    (13, 3, 72, torch.float16),     # hidden not a power of two
    (3, 2, 1100, torch.bfloat16),   # two column blocks, the last ragged
    (5, 1, 64, torch.float32),
    (0, 2, 64, torch.bfloat16),
])
def test_moe_sum_matches_torch(tokens, top_k, hidden, dtype) -> None:
    g = torch.Generator().manual_seed(tokens + top_k)
    slots = torch.randn(tokens * top_k, hidden, generator=g).to(DEVICE, dtype)
    got = moe_sum(slots, top_k)
    want = slots.view(tokens, top_k, hidden).float().sum(dim=1).to(dtype)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    # float32 sums in another order: at most one rounding step of the output dtype apart
    torch.testing.assert_close(got, want, rtol=0 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)
    if DEVICE == "cuda" and dtype != torch.float32 and tokens:
        # rounded to nearest as torch rounds (the interpreter truncates 16-bit casts)
        assert (got == want).float().mean() > 0.99
