"""The whole engine on CPU: prefix cache reuse, preemption by recompute, outputs in order."""
import random

import pytest

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


def test_same_prompts_twice_hit_the_prefix_cache(llm):
    rng = random.Random(0)
    batch = [rand_prompt(rng, 300), rand_prompt(rng, 600)]
    bm = llm.scheduler.block_manager
    first = llm.generate(batch, GREEDY, use_tqdm=False)
    hits = bm.num_cache_hit_blocks
    second = llm.generate(batch, GREEDY, use_tqdm=False)
    assert bm.num_cache_hit_blocks - hits == 1 + 2  # full blocks: 300 -> 1, 600 -> 2
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]


def test_shared_two_block_prefix_shares_physical_blocks(llm):
    rng = random.Random(1)
    prefix = rand_prompt(rng, 512)
    a, b = prefix + rand_prompt(rng, 40), prefix + rand_prompt(rng, 70)
    scheduler, bm = llm.scheduler, llm.scheduler.block_manager
    seqs = []
    for prompt in (a, b):  # b is admitted once a's prefill has run (and hashed its blocks)
        llm.add_request(prompt, GREEDY)
        batch, is_prefill = scheduler.schedule()
        assert is_prefill and len(batch) == 1
        token_ids = llm.model_runner.run(batch, is_prefill).tolist()
        scheduler.commit(scheduler.advance(batch, [True]), token_ids)
        seqs += batch
    assert seqs[0].block_table[:2] == seqs[1].block_table[:2]
    assert [bm.blocks[i].ref_count for i in seqs[0].block_table[:2]] == [2, 2]
    assert seqs[1].num_cached_tokens == len(b)  # 512 from the cache, then its own prefill
    while not llm.is_finished():
        llm.step()
    cached_b = seqs[1].completion_token_ids
    alone = llm.generate([b], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert cached_b == alone


def test_prompt_of_exactly_whole_blocks(llm):
    rng = random.Random(2)
    prompt = rand_prompt(rng, 512)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert first == again and len(again) == 24


def test_preemption_gives_the_unconstrained_outputs(tiny_model, llm):
    rng = random.Random(3)
    batch = [rand_prompt(rng, 200 + 20 * i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    expected = llm.generate(batch, params, use_tqdm=False)
    small = LLM(tiny_model, num_kvcache_blocks=7)  # 6 x 2 blocks needed at the end; 7 exist
    outs = small.generate(batch, params, use_tqdm=False)
    assert small.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in expected]
    assert small.scheduler.block_manager.num_free_blocks == 7
    small.shutdown()


def test_string_prompts_and_input_order(llm):
    outs = llm.generate(["hello world", "the quick brown fox jumps"],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [5, 5]
    assert all(isinstance(o["text"], str) for o in outs)


def test_generate_returns_its_own_requests_and_step_the_others(llm):
    assert llm.step() == ([], 0)
    other = llm.add_request([5, 6, 7], GREEDY)  # queued by hand: not part of the next call
    outs = llm.generate([[8, 9, 10]], GREEDY, use_tqdm=False)
    assert len(outs) == 1 and len(outs[0]["token_ids"]) == 24
    assert outs[0]["request_id"] != other
    assert not llm.is_finished()  # the hand-queued request finished, but nobody has it yet
    outputs, num_tokens = llm.step()  # nothing left to run: it returns the kept output
    assert num_tokens == 0 and [o["request_id"] for o in outputs] == [other]
    assert outputs[0]["token_ids"] == llm.generate([[5, 6, 7]], GREEDY,
                                                   use_tqdm=False)[0]["token_ids"]
    assert llm.is_finished() and llm.step() == ([], 0)


def test_step_outputs_are_generate_outputs(llm):
    prompt = [11, 12, 13, 14]
    request_id = llm.add_request(prompt, GREEDY)
    outputs = []
    while not llm.is_finished():
        outputs += llm.step()[0]
    (out,) = outputs
    expected = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out["request_id"] == request_id and out.keys() == expected.keys()
    assert {k: out[k] for k in ("text", "token_ids", "finish_reason")} == {
        k: expected[k] for k in ("text", "token_ids", "finish_reason")}


def test_fields_mutated_after_construction_are_checked_again(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9)
    params.top_p = 0.0
    with pytest.raises(ValueError, match="request 0: .*top_p"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
