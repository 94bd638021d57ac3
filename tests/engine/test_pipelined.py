"""The pipelined engine (next step launched before the previous step's ids are read) gives
exactly what the lockstep engine gives: same tokens, finish reasons, texts and cache hits."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.sequence import Sequence

PROMPTS = [[(11 * i + 3 * j) % 400 + 2 for j in range(230 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=7)  # 6 sequences crossing a block: preemptions
    yield engine
    engine.shutdown()


def run(llm, prompts, params, pipelined: bool) -> tuple[list[dict], dict]:
    llm._pipelined = pipelined  # the engine's private test hook (see LLMEngine)
    llm.reset_prefix_cache()
    llm.reset_stats()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm._pipelined = True
    return [{k: o[k] for k in ("token_ids", "finish_reason", "text")} for o in outs], llm.stats()


def mixed_params(llm) -> list[SamplingParams]:
    """Greedy, seeded and stop conditions, some of which fire mid-run."""
    greedy = run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=40), False)[0][0]
    stop_id = greedy["token_ids"][7]
    stop_text = llm.tokenizer.decode(greedy["token_ids"][10:12])
    return [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]),
            SamplingParams(temperature=0.8, max_tokens=35, seed=5),
            SamplingParams(temperature=0, max_tokens=40, stop=stop_text),
            SamplingParams(temperature=1.0, max_tokens=30, seed=9, top_k=20),
            SamplingParams(temperature=0, max_tokens=40),
            SamplingParams(temperature=0.6, max_tokens=1, seed=1)]


def test_pipelined_equals_lockstep_under_preemption(llm):
    params = mixed_params(llm)
    lockstep, _ = run(llm, PROMPTS, params, pipelined=False)
    pipelined, stats = run(llm, PROMPTS, params, pipelined=True)
    assert pipelined == lockstep
    assert stats["preemptions"] > 0
    assert {o["finish_reason"] for o in pipelined} == {"stop", "length"}
    assert llm.is_finished() and not llm.scheduler.block_manager.used_block_ids


def test_blocks_filled_in_decode_are_cached(llm):
    # 250 prompt tokens + 20 generated fill block 0 during decode; a prompt extending that
    # output must hit it, and only correct K/V there gives the lockstep tokens.
    prompt, params = PROMPTS[2][:250], SamplingParams(temperature=0, max_tokens=20)
    results = []
    for pipelined in (False, True):
        llm._pipelined = pipelined
        llm.reset_prefix_cache()
        first = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
        llm.reset_stats()
        second = llm.generate([prompt + first], params, use_tqdm=False)[0]["token_ids"]
        results.append((first, second, llm.stats()["cache_hit_blocks"]))
    llm._pipelined = True
    assert results[0] == results[1]
    assert results[1][2] == 1


def test_step_by_step_returns_each_sequence_once(llm):
    ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=5)) for p in PROMPTS[:3]]
    finished = []
    while not llm.is_finished():
        finished += llm.step()[0]
    assert sorted(o["request_id"] for o in finished) == sorted(ids)
    assert all(len(o["token_ids"]) == 5 and o["finish_reason"] == "length" for o in finished)
    assert llm._in_flight is None


def test_exception_in_a_bare_step_requeues_every_request(llm, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o["token_ids"] for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    ids = [llm.add_request(p, params) for p in PROMPTS[:3]]
    launch, calls = llm._launch, [0]

    def failing_launch(*args):
        calls[0] += 1
        if calls[0] == 3:  # a decode step: the batch before it already has pending tokens
            raise RuntimeError("boom")
        return launch(*args)

    monkeypatch.setattr(llm, "_launch", failing_launch)
    finished = []
    with pytest.raises(RuntimeError, match="boom"):
        while not llm.is_finished():
            finished += llm.step()[0]
    assert not finished and llm._in_flight is None
    assert all(not seq.num_pending_tokens and len(seq.token_ids) == len(seq)
               for seq in llm.scheduler.waiting)
    while not llm.is_finished():
        finished += llm.step()[0]
    by_id = {o["request_id"]: o["token_ids"] for o in finished}
    assert [by_id[i] for i in ids] == expected


def test_new_tokens_keep_their_logprobs_aligned_under_preemption(llm):
    """What AsyncLLM streams: the tokens each step committed, with their logprob dicts, read
    between steps of the pipelined engine while sequences are preempted and recomputed."""
    llm.reset_prefix_cache()
    llm.reset_stats()
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True,
                             logprobs=[0, 2, None][i % 3]) for i in range(len(PROMPTS))]
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    asked = dict(zip(ids, (sp.logprobs is not None for sp in params)))
    read = {i: ([], []) for i in ids}
    num_read, outputs = dict.fromkeys(ids, 0), {}
    while not llm.is_finished():
        for out in llm.step()[0]:
            outputs[out["request_id"]] = out
            del num_read[out["request_id"]]
        for request_id, (tokens, logprobs) in llm.new_tokens(num_read).items():
            num_read[request_id] += len(tokens)
            read[request_id][0].extend(tokens)
            if asked[request_id]:
                assert len(logprobs) == len(tokens)
                # each dict holds its own sampled token: an off-by-one would miss it
                assert all(t in entry for t, entry in zip(tokens, logprobs))
                read[request_id][1].extend(logprobs)
            else:
                assert logprobs is None
    assert llm.stats()["preemptions"] > 0
    for request_id, (tokens, logprobs) in read.items():
        out = outputs[request_id]
        assert len(out["token_ids"]) == 30 and 0 < len(tokens) <= 30
        assert out["token_ids"][:len(tokens)] == tokens
        if asked[request_id]:
            assert len(out["logprobs"]) == 30 and out["logprobs"][:len(logprobs)] == logprobs
            assert all(t in entry for t, entry in zip(out["token_ids"], out["logprobs"]))
        else:
            assert out["logprobs"] is None


@pytest.mark.parametrize("source_rows", [[0, 1, 2], [2, -1, 0], [1, 0, 2], [-1, -1, -1]])
def test_decode_inputs_take_pending_ids_from_their_source_rows(llm, source_rows):
    """Row i's input id is row source_rows[i] of the in-flight step's ids, or its own last token
    (-1); rows that decoded together in order take the one-copy path."""
    block = llm.config.kvcache_block_size
    seqs = []
    for i in range(3):
        seq = Sequence([5 + i] * (10 + i), SamplingParams(), block)
        seq.block_table = [i]
        seqs.append(seq)
    previous = torch.tensor([101, 102, 103, 104])  # sampled ids are int64
    input_ids, positions, _ = llm.model_runner.prepare_decode(seqs, previous, source_rows)
    assert input_ids.dtype == torch.int32
    assert input_ids.tolist()[:3] == [101 + r if r >= 0 else seq.last_token
                                      for r, seq in zip(source_rows, seqs)]
    assert positions.tolist()[:3] == [9, 10, 11]
