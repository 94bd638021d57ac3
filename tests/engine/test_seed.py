"""LLM(seed=...) (vLLM's engine argument, default 0): the sampler's draws come from generators
of that seed, so a new engine repeats its samples; None leaves them to torch's global RNG."""
import pytest
import torch

from nanovllm import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
KW = dict(max_tokens=24, ignore_eos=True)
# the fast path (temperature only), the full path (a filter) and n > 1, all unseeded
PARAMS = [SamplingParams(temperature=1.0, **KW), SamplingParams(temperature=0.9, top_k=50, **KW),
          SamplingParams(temperature=1.2, n=2, **KW)]


def _samples(llm: LLM, calls: int = 1) -> list[list[list[int]]]:
    return [[c["token_ids"] for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)
             for c in out["outputs"]] for _ in range(calls)]


def _engine_samples(tiny_model: str, calls: int = 1, **kwargs) -> list[list[list[int]]]:
    llm = LLM(tiny_model, num_kvcache_blocks=16, **kwargs)
    try:
        return _samples(llm, calls)
    finally:
        llm.shutdown()


def test_a_new_engine_repeats_its_samples(tiny_model):
    torch.manual_seed(1)
    first = _engine_samples(tiny_model, calls=2)
    torch.manual_seed(2)  # the global RNG plays no part
    assert _engine_samples(tiny_model, calls=2) == first
    assert first[0] != first[1]  # one engine's calls draw on from where the last stopped
    assert _engine_samples(tiny_model, seed=7) != first[:1]


def test_seed_none_leaves_the_draws_to_torch(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16, seed=None)
    try:
        torch.manual_seed(3)
        first = _samples(llm)
        torch.manual_seed(3)
        assert _samples(llm) == first
        torch.manual_seed(4)
        assert _samples(llm) != first
    finally:
        llm.shutdown()


@pytest.mark.parametrize("seed", [-1, 2**63, True, 1.5, "0"])
def test_a_bad_seed_is_refused(tiny_model, seed):
    with pytest.raises(ValueError, match=rf"seed={seed!r} is invalid: expected None or an int"):
        LLM(tiny_model, seed=seed)
