"""Logit steering (layers.sampling.steering) against a torch reference, and inside the Sampler."""
from copy import copy

import pytest
import torch

from nanovllm.layers.sampling.sampler import Sampler, SamplingTensors
from nanovllm.layers.sampling.steering import Steering, banned_tokens
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

V = 32
NEG = float("-inf")


def upload(rows: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def seq(prompt: list[int], completion: list[int], params: SamplingParams,
        bad_words: list[list[int]] | None = None, stop_ids: list[int] = ()) -> Sequence:
    """A sequence whose completion is on the host, with the ids validation would resolve."""
    params = copy(params)
    params._bad_words_token_ids = bad_words
    params._min_tokens_stop_ids = list(stop_ids)
    s = Sequence(prompt + completion, params, block_size=16)
    s.num_prompt_tokens = len(prompt)
    return s


def reference(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Row by row, dense: allowed set, banned ids, then the bias added."""
    out = logits.clone().float()
    for row, s in enumerate(seqs):
        p = s.sampling_params
        if p.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            out[row, ~keep] = NEG
        for t in banned_tokens(s):
            out[row, t] = NEG
        for t, b in (p.logit_bias or {}).items():
            out[row, t] += b
    return out


def test_banned_tokens_follow_vllm_rule():
    words = [[7], [3, 4], [1, 2, 5]]
    params = SamplingParams(bad_words=["x"])
    # single-token words always; [3, 4] after a completion ending in 3; [1, 2, 5] after 1, 2
    assert banned_tokens(seq([9], [], params, words)) == [7]
    assert banned_tokens(seq([9], [0, 3], params, words)) == [7, 4]
    assert banned_tokens(seq([9], [1, 2], params, words)) == [7, 5]
    # the prompt is not the completion: a prefix that ends the prompt does not count
    assert banned_tokens(seq([1, 2], [], params, words)) == [7]
    assert banned_tokens(seq([1], [2], params, words)) == [7]


def test_min_tokens_bans_stop_ids_until_the_completion_is_long_enough():
    params = SamplingParams(min_tokens=2, stop_token_ids=[5])
    assert banned_tokens(seq([9], [], params, stop_ids=[0, 5])) == [0, 5]
    assert banned_tokens(seq([9], [1], params, stop_ids=[0, 5])) == [0, 5]
    assert banned_tokens(seq([9], [1, 1], params, stop_ids=[0, 5])) == []


def test_build_and_apply_match_the_dense_reference():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    seqs = [
        seq([1], [2], SamplingParams()),  # unsteered row between steered ones
        seq([1], [3], SamplingParams(allowed_token_ids=[4, 9, 9, 30], logit_bias={9: 2.5, 0: 1})),
        seq([1], [3], SamplingParams(bad_words=["x"], logit_bias={4: -100}), [[3, 6], [8]]),
        seq([1], [], SamplingParams(min_tokens=1, logit_bias={5: 100}), stop_ids=[5, 31]),
        seq([1], [2], SamplingParams(allowed_token_ids=[1, 2])),
    ]
    steering = Steering.build(seqs, upload)
    out = steering.apply(logits)
    torch.testing.assert_close(out, reference(logits, seqs))
    assert out[3, 5] == NEG  # a bias never lifts a banned token
    assert out[1, 0] == NEG  # nor one outside the allowed set
    assert logits.isfinite().all()  # the input is untouched


def test_nothing_is_built_for_rows_that_do_not_steer():
    seqs = [seq([1], [2], SamplingParams()), seq([1], [2], SamplingParams(min_tokens=1))]
    assert Steering.build(seqs, upload) is None  # min_tokens reached: nothing to do
    assert SamplingParams().simple and not SamplingParams(min_tokens=1).simple
    assert not SamplingParams(temperature=0, logit_bias={1: 1.0}).simple


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_sampler_greedy_follows_the_bias_and_raw_logprobs_stay_the_models(mode):
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=0, logit_bias={7: 100}), SamplingParams(temperature=0)]
    seqs = [seq([1], [], p) for p in params]
    tensors = SamplingTensors.build(params, [1, 1], upload, Steering.build(seqs, upload))
    out = Sampler(mode)(logits, tensors, num_logprobs=0)
    assert out.token_ids.tolist() == [7, int(logits[1].argmax())]
    expected = logits.log_softmax(-1)[0, 7] if mode == "raw" else torch.tensor(0.0)
    torch.testing.assert_close(out.logprobs.logprobs[0, 0], expected, atol=1e-4, rtol=0)
