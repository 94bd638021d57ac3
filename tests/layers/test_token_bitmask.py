"""The structured-output token bitmask: filled from matchers, applied as xgrammar applies it."""
import pytest
import torch

from nanovllm.layers.sampling.sampler import Sampler
from nanovllm.layers.sampling.token_bitmask import apply_token_bitmask, fill_token_bitmask

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


def allow_only(vocab: int, token: int) -> object:
    """An xgrammar matcher that allows one token (no token is another's prefix)."""
    words = [f"w{i:04d}" for i in range(vocab)]
    info = xgrammar.TokenizerInfo(words)
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(f'root ::= "{words[token]}"')
    return xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)


def test_fill_leaves_unconstrained_rows_whole_and_none_without_matchers():
    cpu = torch.device("cpu")
    assert fill_token_bitmask([None, None], 100, cpu) is None
    bitmask = fill_token_bitmask([None, allow_only(100, 70), None, allow_only(100, 3)], 100, cpu)
    allowed = apply_token_bitmask(torch.zeros(4, 100), bitmask).isfinite()
    assert allowed[0].all() and allowed[2].all()
    assert allowed[1].nonzero().flatten().tolist() == [70]
    assert allowed[3].nonzero().flatten().tolist() == [3]


def test_sampler_draws_only_allowed_tokens_and_keeps_raw_logprobs():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    bitmask = fill_token_bitmask([allow_only(64, 5), None], 64, torch.device("cpu"))
    out = Sampler("raw")(logits, torch.tensor([1.0, 0.0]), None, 1, bitmask)
    assert out.token_ids.tolist() == [5, int(logits[1].argmax())]
    # raw logprobs are the model's own, before the mask
    assert torch.allclose(out.logprobs.logprobs[0, 0], logits[0].log_softmax(-1)[5])
