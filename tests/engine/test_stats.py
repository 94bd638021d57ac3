"""LLM.stats(): exact counters for a crafted prefix workload and a known preemption."""
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams

BLOCK = 256  # the default kvcache_block_size


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny ops: on a shared CI box, fanning them out to threads costs more than it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 512) for _ in range(n)]


def test_shared_two_block_prefix_counts(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=32)
    rng = random.Random(0)
    prefix = rand_tokens(rng, 2 * BLOCK)
    prompts = [prefix + rand_tokens(rng, 40 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Blocks are hashed once a step has written them: the first request computes the prefix,
    # then three more requests, in one prefill step, hit both of its blocks.
    llm.generate(prompts[:1], params, use_tqdm=False)
    llm.reset_stats()
    llm.generate(prompts[1:], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["cache_hit_blocks"] == 3 * 2
    assert stats["prefill_steps"] == 1
    assert stats["prefill_tokens"] == sum(map(len, prompts[1:])) - 3 * 2 * BLOCK
    # Every request's first token comes from prefill, the other 7 from 7 decode steps of 3.
    assert stats["decode_steps"] == 7 and stats["decode_tokens"] == 3 * 7
    # The prefix's 2 blocks are shared; each request adds one block for its suffix.
    assert stats["peak_kv_blocks_in_use"] == 2 + 3
    assert stats["preemptions"] == 0 and stats["recomputed_tokens"] == 0
    assert stats["prefill_tok_s"] == pytest.approx(stats["prefill_tokens"] / stats["prefill_s"])
    assert stats["decode_tok_s"] == pytest.approx(stats["decode_tokens"] / stats["decode_s"])
    assert "timeline" not in stats
    llm.shutdown()


def test_without_prefix_caching_every_prompt_is_prefilled_whole(tiny_model):
    """enable_prefix_caching=False (vLLM's name): the same workload hits no block, computes
    every prompt token, and gives the cached engine's tokens."""
    rng = random.Random(0)
    prefix = rand_tokens(rng, 2 * BLOCK)
    prompts = [prefix + rand_tokens(rng, 40 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        llm = LLM(tiny_model, num_kvcache_blocks=32, enable_prefix_caching=caching)
        try:
            first = llm.generate(prompts[:1], params, use_tqdm=False)
            llm.reset_stats()
            outs[caching] = first + llm.generate(prompts[1:], params, use_tqdm=False)
            stats = llm.stats()
        finally:
            llm.shutdown()
        hits = 3 * 2 if caching else 0
        assert stats["cache_hit_blocks"] == hits
        assert stats["prefill_tokens"] == sum(map(len, prompts[1:])) - hits * BLOCK
    assert [o["token_ids"] for o in outs[False]] == [o["token_ids"] for o in outs[True]]
    with pytest.raises(ValueError, match=r"enable_prefix_caching='no' is invalid: expected a bool"):
        LLM(tiny_model, enable_prefix_caching="no")

def test_preemption_in_a_tiny_pool(tiny_model):
    pool = 8
    llm = LLM(tiny_model, num_kvcache_blocks=pool)
    rng = random.Random(1)
    prompts = [rand_tokens(rng, 200) for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    llm.reset_stats(timeline=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    # 8 one-block sequences fill the pool; at token 257 each needs a second block, so the
    # decode step keeps the first 4 by preempting the last 4 (their freed blocks go to the
    # first 4). Those come back as 4 x 257 tokens once the first 4 finish; nothing is cached.
    assert stats["preemptions"] == 4
    assert stats["recomputed_tokens"] == 4 * 257
    assert stats["prefill_tokens"] == 8 * 200 + 4 * 257
    assert stats["peak_kv_blocks_in_use"] == pool
    assert stats["cache_hit_blocks"] == 0
    assert [len(o["token_ids"]) for o in outs] == [120] * 8
    # Each token comes from a prefill (first token, and again on a recompute) or a decode step.
    assert stats["decode_tokens"] == 8 * 120 - 8 - 4
    timeline = stats["timeline"]
    assert len(timeline) == stats["prefill_steps"] + stats["decode_steps"]
    assert sum(e[4] for e in timeline if e[2]) == stats["prefill_tokens"]
    assert max(e[3] for e in timeline if not e[2]) == 8
    assert all(b[0] >= a[0] + a[1] for a, b in zip(timeline, timeline[1:]))
    llm.reset_stats()
    zeroed = llm.stats()
    assert all(v == 0 for v in zeroed.values()), zeroed
    llm.shutdown()
