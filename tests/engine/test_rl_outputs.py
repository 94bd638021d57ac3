"""Logprobs, prompt logprobs, penalties and n against transformers (float32, CPU)."""
import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from nanovllm import LLM, SamplingParams
from tests.reference import hf_greedy, load_hf

NUM_TOKENS = 6
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_model):
    return load_hf(tiny_model)


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=24)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    # 300 tokens: one full 256-token block (shareable through the prefix cache) and a tail
    return [[rng.randrange(3, 400) for _ in range(n)] for n in (300, 11, 1)]


@torch.inference_mode()
def hf_log_softmax(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] log_softmax of transformers' logits at every position."""
    return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].double(), -1)


def check_entry(entry: dict[int, float], reference: torch.Tensor, token: int, k: int) -> None:
    """{token_id: logprob} holds `token` and the reference's top k, with its values."""
    assert set(reference.topk(k).indices.tolist()) | {token} == set(entry)
    for t, lp in entry.items():
        assert abs(lp - reference[t].item()) < ATOL, (t, lp, reference[t].item())


def test_logprobs_and_prompt_logprobs_match_transformers(llm, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    for _ in range(2):  # the second run finds the prompt's head in the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            tokens = prompt + out["token_ids"]
            reference = hf_log_softmax(hf, tokens)
            assert out["token_ids"] == hf_greedy(hf, prompt, NUM_TOKENS)
            assert len(out["logprobs"]) == NUM_TOKENS
            for j, entry in enumerate(out["logprobs"]):
                check_entry(entry, reference[len(prompt) + j - 1], tokens[len(prompt) + j], 3)
            assert len(out["prompt_logprobs"]) == len(prompt)
            assert out["prompt_logprobs"][0] is None
            for p, entry in enumerate(out["prompt_logprobs"][1:], start=1):
                check_entry(entry, reference[p - 1], prompt[p], 2)
            assert out["outputs"] == [{key: out[key] for key in
                                       ("text", "token_ids", "finish_reason", "logprobs")}]


def test_prompt_logprobs_after_a_cache_hit_and_their_blocks_are_shared(llm, hf, prompts):
    """A cached prompt is recomputed for its prompt logprobs; its blocks serve later hits."""
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.reset_prefix_cache()
    llm.generate(prompts[0], plain, use_tqdm=False)  # caches the full block
    llm.reset_stats()
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                  prompt_logprobs=0), use_tqdm=False)[0]
    assert llm.stats()["prefill_tokens"] == len(prompts[0])
    reference = hf_log_softmax(hf, prompts[0])
    for p, entry in enumerate(out["prompt_logprobs"][1:], start=1):
        check_entry(entry, reference[p - 1], prompts[0][p], 0)
    assert out["logprobs"] is None
    llm.reset_stats()
    llm.generate(prompts[0], plain, use_tqdm=False)
    assert llm.stats()["cache_hit_blocks"] == 1


def test_processed_logprobs_are_the_distribution_sampled_from(tiny_model, hf, prompts):
    """log_softmax(top-5 of logits / 0.7) at each step, against transformers' logits."""
    llm = LLM(tiny_model, num_kvcache_blocks=8, logprobs_mode="processed")
    try:
        params = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=NUM_TOKENS,
                                ignore_eos=True, logprobs=2)
        out = llm.generate(prompts[1], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    tokens = prompts[1] + out["token_ids"]
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens])).logits[0].double() / 0.7
    for j, entry in enumerate(out["logprobs"]):
        row = logits[len(prompts[1]) + j - 1]
        masked = torch.full_like(row, float("-inf"))
        top = row.topk(5).indices
        masked[top] = row[top]
        check_entry(entry, torch.log_softmax(masked, -1), tokens[len(prompts[1]) + j], 2)


def penalised_greedy(hf, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with transformers' repetition penalty processor and OpenAI's presence
    and frequency penalties applied to transformers' logits, one step at a time."""
    tokens, generated = list(prompt), []
    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = hf(torch.tensor([tokens])).logits[:, -1].float()
            logits = repetition(torch.tensor([tokens]), logits)[0]
            for t in set(generated):
                logits[t] -= params.frequency_penalty * generated.count(t)
                logits[t] -= params.presence_penalty
            token = int(logits.argmax())
            tokens.append(token)
            generated.append(token)
    return generated


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.8),
                                     dict(repetition_penalty=0.5),
                                     dict(presence_penalty=1.5),
                                     dict(frequency_penalty=0.9)])
def test_greedy_with_a_penalty_equals_the_reference_loop(llm, hf, prompts, penalty):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **penalty)
    outs = llm.generate(prompts[1:], params, use_tqdm=False)
    expected = [penalised_greedy(hf, p, params) for p in prompts[1:]]
    assert [o["token_ids"] for o in outs] == expected
    plain = [hf_greedy(hf, p, 12) for p in prompts[1:]]
    assert expected != plain  # the penalty changed something


def test_n_greedy_gives_n_copies_of_transformers_tokens(llm, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, n=3,
                            logprobs=1)
    outs = llm.generate(prompts[:2], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(hf, prompt, NUM_TOKENS)
        assert [c["token_ids"] for c in out["outputs"]] == [expected] * 3
        assert out["token_ids"] == expected and out["text"] == out["outputs"][0]["text"]
        for a, b in zip(out["outputs"][0]["logprobs"], out["outputs"][2]["logprobs"]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < ATOL for t in a)


def test_n_sampling_gives_distinct_completions_from_one_prefill(llm, prompts):
    prompt, block = prompts[0], 256
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=4, seed=11)
    llm.reset_prefix_cache()
    llm.reset_stats()
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    # the full block is computed once; each completion computes the tail itself
    assert llm.stats()["prefill_tokens"] == len(prompt) + 3 * (len(prompt) - block)
    completions = [tuple(c["token_ids"]) for c in out["outputs"]]
    assert len(set(completions)) == 4
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [tuple(c["token_ids"]) for c in again["outputs"]] == completions
    single = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=11,
                                                 ignore_eos=True), use_tqdm=False)[0]
    assert tuple(single["token_ids"]) == completions[0]


def test_tensor_parallel_logprobs_and_penalties(tiny_model, hf, prompts):
    """TP=2 (gloo): the gathered logits give the same logprobs; penalties run on rank 0."""
    llm = LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=16)
    try:
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                logprobs=2, prompt_logprobs=1)
        outs = llm.generate(prompts[:2], params, use_tqdm=False)
        penalised = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                   repetition_penalty=1.8, frequency_penalty=0.5)
        got = llm.generate(prompts[1], penalised, use_tqdm=False)[0]["token_ids"]
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        tokens = prompt + out["token_ids"]
        reference = hf_log_softmax(hf, tokens)
        for j, entry in enumerate(out["logprobs"]):
            check_entry(entry, reference[len(prompt) + j - 1], tokens[len(prompt) + j], 2)
        for p, entry in enumerate(out["prompt_logprobs"][1:], start=1):
            check_entry(entry, reference[p - 1], prompt[p], 1)
    assert got == penalised_greedy(hf, prompts[1], penalised)


def test_add_request_with_n_gives_one_output_once_every_completion_finished(llm, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2)
    request_id = llm.add_request(prompts[1], params)
    outs = []
    while not llm.is_finished():
        outs += llm.step()[0]
    assert [out["request_id"] for out in outs] == [request_id]
    assert [c["token_ids"] for c in outs[0]["outputs"]] == [hf_greedy(hf, prompts[1], 3)] * 2


def test_prompt_logprobs_of_a_chunked_prefill_preempted_midway(tiny_model, hf, monkeypatch):
    """Budget 100, pool of 4 blocks: a 700-token prompt is scored chunk by chunk, preempted
    mid-prefill by a decoding request (see test_chunked_prefill), recomputed from position 0;
    its prompt logprobs are still one entry per prompt token, equal to transformers'."""
    llm = LLM(tiny_model, num_kvcache_blocks=4, max_num_batched_tokens=100)
    rng = random.Random(9)
    short, long = ([rng.randrange(1, 500) for _ in range(n)] for n in (250, 700))
    preempted = []
    preempt = llm.scheduler.preempt
    monkeypatch.setattr(llm.scheduler, "preempt",
                        lambda seq: (preempted.append(seq.num_cached_tokens), preempt(seq)))
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)]
    out = llm.generate([short, long], params, use_tqdm=False)[1]
    llm.shutdown()
    assert preempted and all(0 < cached < 700 for cached in preempted)
    reference = hf_log_softmax(hf, long)
    assert len(out["prompt_logprobs"]) == len(long) and out["prompt_logprobs"][0] is None
    for p, entry in enumerate(out["prompt_logprobs"][1:], start=1):
        check_entry(entry, reference[p - 1], long[p], 1)
