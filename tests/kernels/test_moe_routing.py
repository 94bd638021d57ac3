"""The one-launch top-k routing kernel against torch's softmax + topk (TRITON_INTERPRET on
CPU): the same experts in the same order, the same weights to their dtype's rounding."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.moe.reference import select_experts_torch  # noqa: E402
from nanovllm.kernels.moe.routing import select_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,experts,top_k,renormalize,dtype", [
    (1, 128, 8, True, torch.bfloat16),     # Qwen3-30B-A3B at batch 1
    (37, 128, 8, True, torch.bfloat16),    # rows past a program's 16
    (37, 128, 8, True, torch.float32),
    (20, 60, 4, False, torch.float16),     # experts not a power of two, no renormalisation
    (5, 8, 1, True, torch.float32),        # top-1
    (3, 6, 6, False, torch.float32),       # every expert
])
def test_routing_matches_torch(tokens, experts, top_k, renormalize, dtype) -> None:
    """A top-k set of the float32 softmax, best first, with torch's weights; in float32 (no
    equal logits) torch's very ids. 16-bit logits tie often: which of two equal experts torch
    takes is its own choice, so there the selection is checked, not the ids."""
    g = torch.Generator().manual_seed(tokens * experts + top_k)
    logits = (torch.randn(tokens, experts, generator=g) * 3).to(DEVICE, dtype)
    weights, ids = select_experts(logits, top_k, renormalize)
    ref_weights, ref_ids = select_experts_torch(logits, top_k, renormalize)
    assert ids.dtype == ref_ids.dtype and weights.dtype == dtype
    torch.testing.assert_close(weights, ref_weights, rtol=1e-2 if dtype != torch.float32
                               else 1e-5, atol=1e-6)
    probs = torch.softmax(logits.float(), dim=-1)
    taken = probs.gather(1, ids)
    assert torch.equal(taken, probs.topk(top_k, dim=-1).values)  # a top-k set, best first
    assert all(len(set(row)) == top_k for row in ids.tolist())  # distinct experts
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    if renormalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(tokens, device=DEVICE),
                                   rtol=2e-2, atol=0)


def test_routing_takes_the_lower_id_among_equals() -> None:
    """Equal logits: torch's order among ties is its own; ours takes ascending ids, and the
    weights split evenly."""
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[1, 5] = 1.0
    weights, ids = select_experts(logits, 3, renormalize=True)
    assert ids.tolist() == [[0, 1, 2], [5, 0, 1]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3, device=DEVICE))


def test_routing_reads_strided_rows() -> None:
    """Router logits whose rows are a slice of wider rows (a stride other than the width)."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(9, 80, generator=g).to(DEVICE)
    logits = wide[:, 10:70]
    weights, ids = select_experts(logits, 4, True)
    ref_weights, ref_ids = select_experts_torch(logits, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)


def test_routing_of_no_tokens() -> None:
    weights, ids = select_experts(torch.zeros(0, 16, device=DEVICE), 2, True)
    assert weights.shape == ids.shape == (0, 2)
