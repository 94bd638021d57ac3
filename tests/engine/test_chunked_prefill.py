"""Chunked prefill on every target (tests/targets.py): prompts longer than the token budget are
prefilled over several steps and give transformers' greedy tokens; chunk edges on and off the
256-token block edges, with prefix-cache hits, preemption mid-prefill, and TP=2 (gloo)."""

import pytest

from nanovllm import LLM, SamplingParams
from tests.reference import hf_greedy, ids, load_hf, token_prompts
from tests.targets import make_target, target_params

N = 8  # generated tokens per request


@pytest.fixture(scope="module", params=target_params())
def target(request):
    t = make_target(request.param)
    yield t
    t.close()


def greedy(max_tokens: int = N) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("budget", [100, 256, 300])  # chunk edges off, on, off block edges
def test_long_prompts_in_chunks_equal_transformers(target, tiny_model, budget):
    """Two prompts of about 3x the budget and a short one, submitted together: several
    chunked prompts at once, with decodes between their chunks."""
    llm = target.llm(tiny_model, max_num_batched_tokens=budget)
    prompts = token_prompts(budget, (3 * budget, 20, 3 * budget + 17))
    llm.reset_stats(timeline=True)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    target.check_greedy(tiny_model, prompts, ids(outs))
    stats = llm.stats()
    timeline = stats["timeline"]
    assert stats["prefill_tokens"] == sum(map(len, prompts))
    assert max(e[4] for e in timeline if e[2]) <= budget  # the budget caps every step
    assert stats["prefill_steps"] >= -(-sum(map(len, prompts)) // budget)
    assert sum(abs(e[4]) for e in timeline) == stats["prefill_tokens"] + stats["decode_tokens"]
    # Once the short prompt decodes, no two chunk steps run back to back.
    kinds = "".join("P" if e[2] else "D" for e in timeline)
    first_decode = kinds.index("D")
    assert "PP" not in kinds[first_decode:].rstrip("D"), kinds


def test_chunks_start_after_a_prefix_cache_hit(target, tiny_model):
    """A prompt whose first two blocks are cached prefills only its tail, in chunks of 100
    whose edges fall inside blocks."""
    llm = target.llm(tiny_model, max_num_batched_tokens=100)
    shared = token_prompts(7, (512,))[0]
    prompts = [shared + tail for tail in token_prompts(8, (30, 333))]
    first = llm.generate(prompts[0], greedy(), use_tqdm=False)
    llm.reset_stats()
    second = llm.generate(prompts[1], greedy(), use_tqdm=False)
    stats = llm.stats()
    assert stats["cache_hit_blocks"] == 2
    assert stats["prefill_tokens"] == 333 and stats["prefill_steps"] == 4
    target.check_greedy(tiny_model, prompts, ids(first + second))


def test_preempted_in_the_middle_of_a_chunked_prefill(target, tiny_model, monkeypatch):
    """Pool of 4 blocks, budget 100: a short request decodes between the chunks of a 700-token
    prompt (3 blocks); at its 257th token it needs a 5th block and preempts the long one
    mid-prefill, which is later recomputed (reusing the blocks its chunks had completed)."""
    llm = target.llm(tiny_model, num_kvcache_blocks=4, max_num_batched_tokens=100)
    prompts = token_prompts(9, (250, 700))
    scheduler, preempted = llm.scheduler, []
    preempt = scheduler.preempt

    def record(seq):
        preempted.append((seq.num_prompt_tokens, seq.num_cached_tokens))
        preempt(seq)

    monkeypatch.setattr(scheduler, "preempt", record)
    outs = llm.generate(prompts, [greedy(30), greedy()], use_tqdm=False)
    assert preempted and all(n == 700 and 0 < cached < 700 for n, cached in preempted)
    assert scheduler.block_manager.num_free_blocks == 4
    target.check_greedy(tiny_model, prompts, ids(outs))


def test_lockstep_engine_chunks_the_same_way(tiny_model):
    """The lockstep path (what tensor parallelism runs) on the same chunked workload."""
    llm = LLM(tiny_model, num_kvcache_blocks=16, max_num_batched_tokens=300)
    llm._pipelined = False
    try:
        prompts = token_prompts(11, (900, 20, 650))
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    hf = load_hf(tiny_model)
    assert ids(outs) == [hf_greedy(hf, prompt, N) for prompt in prompts]


def test_tensor_parallel_chunks(tiny_model):
    """TP=2 (gloo): workers receive exactly each step's chunk."""
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16,
              max_num_batched_tokens=100)
    try:
        prompts = token_prompts(12, (350, 5, 260))
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    hf = load_hf(tiny_model)
    assert ids(outs) == [hf_greedy(hf, prompt, N) for prompt in prompts]


def test_longest_prompt_with_a_one_token_budget(tiny_model):
    """max_model_len - 1 prompt tokens, one per step: accepted, and its one token is right."""
    llm = LLM(tiny_model, max_model_len=100, max_num_batched_tokens=1, num_kvcache_blocks=1)
    try:
        prompt = token_prompts(13, (99,))[0]
        llm.reset_stats()
        out = llm.generate(prompt, greedy(), use_tqdm=False)[0]
        assert llm.stats()["prefill_steps"] == 99
    finally:
        llm.shutdown()
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 1
    assert out["token_ids"] == hf_greedy(load_hf(tiny_model), prompt, 1)
