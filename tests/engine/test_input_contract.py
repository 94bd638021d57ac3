"""The input contract, case by case: every value a device tensor cannot hold is refused up front
(changing nothing) or clamped to the same meaning; every prompt form is accepted or refused
naming the request; metrics are ordered; chat() checks conversations itself."""
import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams

PROMPT = [5, 6, 7, 8]
LONG = list(range(1, 300))  # one full 256-token block: a prefix-cache entry


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=4)
    yield engine
    engine.shutdown()


def engine_state(llm) -> tuple:
    bm = llm.scheduler.block_manager
    return (llm.is_finished(), list(bm.free_block_ids), sorted(bm.used_block_ids),
            dict(bm.hash_to_block_id))


def tokens(llm, prompts, params) -> list[list[int]]:
    return [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]


def test_tiny_top_p_keeps_the_top_token(llm):
    # 1e-46 is 0.0 in float32, which would mask every token: it is raised to float32's smallest
    # normal, which keeps exactly the top token, so the draw is greedy.
    greedy = tokens(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for top_p in (1e-46, 1e-40, 5e-324):
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=1, max_tokens=8,
                                ignore_eos=True)
        assert tokens(llm, [PROMPT], params) == greedy
    assert greedy[0] != [0] * 8


def test_top_k_beyond_int64_is_off(llm):
    kw = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert SamplingParams(top_k=2**63, **kw).top_k == -1
    assert SamplingParams(top_k=np.int64(2**62), **kw).top_k == -1
    assert SamplingParams(top_k=0, **kw).top_k == -1  # off, as vLLM
    huge = tokens(llm, [PROMPT], SamplingParams(top_k=2**63, **kw))
    assert huge == tokens(llm, [PROMPT], SamplingParams(top_k=-1, **kw))
    assert huge == tokens(llm, [PROMPT], SamplingParams(top_k=512, **kw))  # the whole vocab


@pytest.mark.parametrize("field, value", [
    ("temperature", 10**400), ("temperature", 1e39), ("temperature", float("inf")),
    ("top_k", -2), ("top_p", 0.0), ("seed", 2**63), ("min_p", float("nan")),
    ("stop_token_ids", [2**64]), ("max_tokens", True), ("top_p", torch.tensor(0.5)),
])
def test_unrepresentable_value_is_refused_and_changes_nothing(llm, field, value):
    tokens(llm, [LONG], SamplingParams(temperature=0, max_tokens=2))  # fill the prefix cache
    hits = llm.stats()["cache_hit_blocks"]
    before = engine_state(llm)
    with pytest.raises(ValueError, match=rf"^{field}=.* is invalid: expected"):
        SamplingParams(**{field: value})
    bad = SamplingParams(temperature=0, max_tokens=2)
    setattr(bad, field, value)  # mutated after construction: generate() checks again
    with pytest.raises(ValueError, match=rf"^request 1: {field}=.* is invalid: expected"):
        llm.generate([PROMPT, LONG], [SamplingParams(), bad], use_tqdm=False)
    assert engine_state(llm) == before
    tokens(llm, [LONG], SamplingParams(temperature=0, max_tokens=2))
    assert llm.stats()["cache_hit_blocks"] == hits + 1  # the cache survived the refusal


def test_numpy_values_are_normalised():
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int32(5), seed=np.uint64(3),
                            max_tokens=np.int16(4), stop_token_ids=[np.int64(2)])
    assert (type(params.temperature), type(params.top_k), type(params.seed)) == (float, int, int)
    assert params.stop_token_ids == [2] and type(params.stop_token_ids[0]) is int


@pytest.mark.parametrize("prompt", [
    np.array(PROMPT), torch.tensor(PROMPT), np.array(PROMPT, dtype=np.int32).reshape(1, -1)])
def test_array_prompt_is_refused_naming_the_request(llm, prompt):
    before = engine_state(llm)
    with pytest.raises(ValueError, match=r"^request 1: prompt must be a str, a list of int "
                                         r"token ids, or a .*pass a list of ints \(e.g. .tolist"):
        llm.generate([PROMPT, prompt], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts must be a prompt .*\.tolist"):
        llm.generate(prompt, use_tqdm=False)
    assert engine_state(llm) == before


def test_every_int_prompt_form_is_one_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = tokens(llm, [PROMPT], params)
    forms = [PROMPT, tuple(PROMPT), [np.int64(t) for t in PROMPT], np.array(PROMPT).tolist(),
             [np.int32(PROMPT[0]), *PROMPT[1:]]]
    for form in forms:
        assert tokens(llm, form, params) == expected  # one prompt
        assert tokens(llm, [form, form], params) == expected * 2  # inside a list of prompts


def test_prompt_dicts_are_vllms_text_and_tokens_prompts(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = tokens(llm, [PROMPT, "hello world"], params)
    dicts = [{"prompt_token_ids": PROMPT}, {"prompt": "hello world"}]
    assert tokens(llm, dicts, params) == plain
    assert tokens(llm, dicts[0], params) == plain[:1]  # one prompt
    assert tokens(llm, {"prompt_token_ids": tuple(PROMPT)}, params) == plain[:1]
    request_id = llm.add_request(dicts[1], params)
    finished = []
    while not llm.is_finished():
        finished += llm.step()[0]
    assert [(out["request_id"], out["token_ids"]) for out in finished] == [
        (request_id, plain[1])]


@pytest.mark.parametrize("prompt, message", [
    ({}, r"exactly one of the keys \['prompt', 'prompt_token_ids'\], got \[\]"),
    ({"prompt": "a", "multi_modal_data": {}}, r"got \['multi_modal_data', 'prompt'\]$"),
    ({"role": "user", "content": "a"}, r"got \['content', 'role'\]; a conversation's messages "
                                       r"go to chat\(\)$"),
    ({"prompt_token_ids": PROMPT, "cache_salt": "s"}, r"got \['cache_salt', 'prompt_token_ids"),
    ({"prompt": PROMPT}, r"'prompt' must be a str, got \[5, 6, 7, 8\] \(list\)"),
    ({"prompt_token_ids": "5 6"}, r"'prompt_token_ids' must be a list of int token ids"),
    ({"prompt_token_ids": np.array(PROMPT)}, r"must be a list of int token ids.*\.tolist"),
    ({"prompt_token_ids": [5, "6"]}, r"prompt token at position 1 is '6' \(str\)"),
    ({"prompt_token_ids": []}, r"is empty \(no tokens\)"),
    ({"prompt_token_ids": [512]}, r"token id 512 at position 0 is outside \[0, 512\)"),
])
def test_bad_prompt_dict_is_refused_naming_the_request(llm, prompt, message):
    before = engine_state(llm)
    with pytest.raises(ValueError, match=r"^request 1: .*" + message):
        llm.generate([PROMPT, prompt], use_tqdm=False)
    assert engine_state(llm) == before


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    params = dict(temperature=0, max_tokens=4, ignore_eos=True)
    long = [1] * 4997 + PROMPT[-3:]  # beyond max_model_len (4,096): its last 3 tokens kept
    expected = tokens(llm, [PROMPT[-3:], PROMPT], SamplingParams(**params))
    assert expected[0] != expected[1]
    assert tokens(llm, [long, PROMPT], SamplingParams(truncate_prompt_tokens=3,
                                                      **params)) == [expected[0], expected[0]]
    assert tokens(llm, [PROMPT], SamplingParams(truncate_prompt_tokens=-1,
                                                **params)) == expected[1:]
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match=rf"^truncate_prompt_tokens={bad} is invalid"):
            SamplingParams(truncate_prompt_tokens=bad)
    before = engine_state(llm)
    with pytest.raises(ValueError, match=r"^request 1: truncate_prompt_tokens=4097 is invalid: "
                                         r"expected -1 \(max_model_len\) or an int in \[1, "
                                         r"max_model_len=4096\]"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(), SamplingParams(
            truncate_prompt_tokens=4097)], use_tqdm=False)
    assert engine_state(llm) == before


def test_max_tokens_none_runs_to_max_model_len(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, min_tokens=3)
    assert (params.max_tokens, params.min_tokens) == (None, 3)
    engine = LLM(tiny_model, max_model_len=40)
    try:
        [out] = engine.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        assert (len(out["token_ids"]), out["finish_reason"]) == (40 - len(PROMPT), "length")
        assert params.max_tokens is None  # the caller's object is not resolved in place
    finally:
        engine.shutdown()


def test_max_tokens_none_beyond_the_pool_is_refused(llm):
    before = engine_state(llm)  # 4 blocks of 256 tokens, max_model_len 4,096
    with pytest.raises(ValueError, match=r"^request 0: prompt of 4 tokens with max_tokens=None "
                                         r"\(capped at max_model_len=4096\) needs 16 KV blocks"):
        llm.generate([PROMPT], SamplingParams(max_tokens=None), use_tqdm=False)
    assert engine_state(llm) == before


@pytest.mark.parametrize("pipelined", [True, False])
def test_ttft_never_exceeds_latency(llm, pipelined):
    saved, llm._pipelined = llm._pipelined, pipelined
    try:
        outs = llm.generate([PROMPT] * 3 + [LONG], SamplingParams(max_tokens=1), use_tqdm=False)
        outs += llm.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False)
    finally:
        llm._pipelined = saved
    for out in outs:
        metrics = out["metrics"]
        assert 0 < metrics["ttft_s"] <= metrics["latency_s"], metrics


@pytest.mark.parametrize("messages, message", [
    ("hello", r"^messages must be a conversation .*got 'hello' \(str\)"),
    ([[]], r"^conversation 0 must be a non-empty list"),
    ([{"role": "user", "content": "hi"}, "hi"], r"^conversation 0, message 1: expected a "),
    ([{"role": "user"}], r"^conversation 0, message 0: expected exactly the keys 'role' and "
                         r"'content', got \['role'\]"),
    ([{"role": "user", "content": "a", "x": 1}], r"^conversation 0, message 0: expected exactly"),
    ([{"role": "user", "content": None}], r"^conversation 0, message 0: content must be a str, "
                                          r"got None"),
    ([{"role": 1, "content": "a"}], r"^conversation 0, message 0: role must be a str"),
    ([{"role": "", "content": "a"}], r"^conversation 0, message 0: role must be a non-empty"),
    ([[{"role": "user", "content": "a"}], [{"role": "user", "content": ["a"]}]],
     r"^conversation 1, message 0: content must be a str, got \['a'\] \(list\)"),
    ([[{"role": "user", "content": "a"}], {"role": "user", "content": "a"}],
     r"^conversation 1 must be a non-empty list"),
])
def test_malformed_conversation_is_refused(llm, messages, message):
    before = engine_state(llm)
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, use_tqdm=False)
    assert engine_state(llm) == before
