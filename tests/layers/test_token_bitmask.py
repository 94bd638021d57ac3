"""The structured-output token bitmask: filled from matchers, applied as xgrammar applies it."""
import pytest
import torch

from nanovllm.layers.sampler import Sampler
from nanovllm.layers.token_bitmask import apply_token_bitmask, fill_token_bitmask

xgrammar = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("vocab", [32, 100, 512])
def test_apply_matches_xgrammar(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), generator=g,
                            dtype=torch.int32)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    assert torch.equal(apply_token_bitmask(logits, bitmask), expected)


class AllowOnly:
    """A stand-in matcher that allows one token."""

    def __init__(self, token: int):
        self.token = token

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)


def test_fill_leaves_unconstrained_rows_whole_and_none_without_matchers():
    cpu = torch.device("cpu")
    assert fill_token_bitmask([None, None], 100, cpu) is None
    bitmask = fill_token_bitmask([None, AllowOnly(70)], 100, cpu)
    allowed = apply_token_bitmask(torch.zeros(2, 100), bitmask).isfinite()
    assert allowed[0].all() and allowed[1].nonzero().flatten().tolist() == [70]


def test_sampler_draws_only_allowed_tokens_and_keeps_raw_logprobs():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    bitmask = fill_token_bitmask([AllowOnly(5), None], 64, torch.device("cpu"))
    out = Sampler("raw")(logits, torch.tensor([1.0, 0.0]), None, 1, bitmask)
    assert out.token_ids.tolist() == [5, int(logits[1].argmax())]
    # raw logprobs are the model's own, before the mask
    assert torch.allclose(out.logprobs.logprobs[0, 0], logits[0].log_softmax(-1)[5])
