"""Random schedules: random prompt lengths, shared prefixes, max_tokens and sampling params in
pools from "barely fits" upward. Greedy rows (and seeded rows) must equal those of the same
engine with a large pool, and greedy rows transformers' (float32 targets: exact)."""
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nanovllm import SamplingParams
from tests.targets import make_target, target_params

BLOCK = 256
MAX_MODEL_LEN = 1024
LARGE_POOL = 64
PREFIX = [random.Random(0).randrange(1, 500) for _ in range(2 * BLOCK + 44)]
EXAMPLES = {"cpu-torch-float32": 4}  # CI on CPU; the GPU targets take GPU_EXAMPLES
GPU_EXAMPLES = 20

REQUEST = st.fixed_dictionaries({
    "shared": st.sampled_from([0, 0, 100, BLOCK, BLOCK + 30, 2 * BLOCK]),  # prefix tokens
    "tail": st.integers(1, 300),
    "max_tokens": st.integers(1, 20),
    "sampling": st.sampled_from(["greedy", "greedy", "seeded", "top_k", "top_p"]),
    "seed": st.integers(0, 2**16),
})


@pytest.fixture(scope="module",
                params=target_params(["cpu-torch-float32", "cuda-triton-float32-eager",
                                      "cuda-triton-float32-graphs"]))
def target(request):
    t = make_target(request.param)
    yield t
    t.close()


def build(req: dict) -> tuple[list[int], SamplingParams]:
    rng = random.Random(req["seed"])
    prompt = PREFIX[:req["shared"]] + [rng.randrange(1, 500) for _ in range(req["tail"])]
    common = dict(max_tokens=req["max_tokens"], ignore_eos=True)
    params = {"greedy": SamplingParams(temperature=0, **common),
              "seeded": SamplingParams(temperature=0.9, seed=req["seed"], **common),
              "top_k": SamplingParams(temperature=1.1, top_k=20, seed=req["seed"], **common),
              "top_p": SamplingParams(top_p=0.8, min_p=0.02, **common)}  # unseeded
    return prompt, params[req["sampling"]]


def barely_fitting_pool(requests: list[tuple[list[int], SamplingParams]]) -> int:
    """The fewest blocks that hold the largest request's peak K/V."""
    peak = max(min(len(p) + sp.max_tokens, MAX_MODEL_LEN) - 1 for p, sp in requests)
    return -(-peak // BLOCK)


def test_random_schedules_match_a_large_pool_and_transformers(target, tiny_model):
    examples = EXAMPLES.get(target.name, GPU_EXAMPLES)
    preemptions = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None)
    @given(reqs=st.lists(REQUEST, min_size=1, max_size=6), extra_blocks=st.integers(0, 3))
    @example(reqs=[dict(shared=100, tail=145, max_tokens=20, sampling=s, seed=i)  # preempts:
                   for i, s in enumerate(["greedy", "seeded", "greedy", "top_p"])],  # a 2nd
             extra_blocks=0)  # block each while decoding, in a pool of 2
    def check(reqs: list[dict], extra_blocks: int) -> None:
        requests = [build(r) for r in reqs]
        prompts, params = [p for p, _ in requests], [sp for _, sp in requests]
        pool = barely_fitting_pool(requests) + extra_blocks
        small = target.llm(tiny_model, num_kvcache_blocks=pool, max_model_len=MAX_MODEL_LEN)
        large = target.llm(tiny_model, num_kvcache_blocks=LARGE_POOL,
                           max_model_len=MAX_MODEL_LEN)
        small.reset_stats()
        got = small.generate(prompts, params, use_tqdm=False)
        preemptions.append(small.stats()["preemptions"])
        ref = large.generate(prompts, params, use_tqdm=False)
        assert all(len(o["token_ids"]) == sp.max_tokens for o, sp in zip(got, params))
        for o, r, sp in zip(got, ref, params):
            if sp.temperature == 0 or sp.seed is not None:
                assert o["token_ids"] == r["token_ids"], (pool, [len(p) for p in prompts])
        greedy = [i for i, sp in enumerate(params) if sp.temperature == 0]
        target.check_greedy(tiny_model, [prompts[i] for i in greedy],
                            [got[i]["token_ids"] for i in greedy])

    check()
    assert sum(preemptions) > 0, preemptions  # the draws did exercise preemption
