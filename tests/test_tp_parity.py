"""tests/accuracy/tp_parity.py: the TP=N vs TP=1 report (issue 5) on CPU with gloo."""
import torch

from tests.accuracy.tp_parity import compare, greedy_run, leftovers

PROMPTS = [[(5 * i + 7 * j) % 400 + 1 for j in range(20 + 30 * i)] for i in range(4)]


def test_compare_stops_comparing_logits_where_tokens_diverge():
    logits = [torch.ones(2, 4) for _ in range(3)]
    other = [torch.ones(2, 4), torch.full((2, 4), 1.5), torch.full((2, 4), 9.0)]
    result = compare(([[1, 2, 3], [4, 5, 6]], logits), ([[1, 2, 3], [4, 7, 6]], other))
    assert result["tokens_equal"] == 5 and result["tokens"] == 6
    # tokens agree at position 0 only: the prefill step and step 1 (which sampled position 1)
    assert result["steps_compared"] == 2 and result["max_abs_logit_diff"] == 0.5


def test_tp2_agrees_with_tp1_and_leaves_nothing_behind(tiny_model):
    kwargs = dict(num_kvcache_blocks=16)
    base = greedy_run(tiny_model, 1, PROMPTS, 12, kwargs)
    other = greedy_run(tiny_model, 2, PROMPTS, 12, kwargs)
    result = compare(base, other)
    assert result["agreement"] == 1.0 and result["steps_compared"] == 12
    assert result["max_rel_logit_diff"] < 1e-4
    assert result["distinct_tokens"] > 5  # not one repeated token: the check has teeth
    assert leftovers() == dict(children=0, shm_segments=0)
