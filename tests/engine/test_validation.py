"""Request validation and limits: bad requests are rejected up front and change nothing;
sequences stop at max_model_len; requests that can never fit the KV pool are refused."""
import math

import pytest

from nanovllm import LLM, SamplingParams

GOOD = [1, 2, 3]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    # 2 blocks of 256 tokens: requests of up to 513 tokens in all fit (the last one's K/V is
    # never stored); vocab 512; max_model_len 4096.
    engine = LLM(tiny_model, num_kvcache_blocks=2)
    yield engine
    engine.shutdown()


def assert_idle_and_empty(llm) -> None:
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and bm.num_free_blocks == len(bm.blocks) and not bm.used_block_ids


@pytest.mark.parametrize("prompt, message", [
    ([], r"prompt \[\] \(list\) is empty"),
    ("", r"prompt '' \(str\) is empty"),
    ([1, 512], r"token id 512 at position 1 is outside \[0, 512\)"),
    ([-1, 2], r"token id -1 at position 0 is outside \[0, 512\)"),
    ([1] * 4096, r"prompt has 4096 tokens; it must have fewer than max_model_len=4096"),
    ([1, "a"], r"prompt token at position 1 is 'a' \(str\)"),
    ([1, 2.0], r"prompt token at position 1 is 2.0 \(float\)"),
    ([True], r"prompt token at position 0 is True \(bool\)"),
    (3.5, r"prompt must be a str, a list of int token ids, or a \{'prompt': str\} or "
          r"\{'prompt_token_ids': list\} dict, got 3.5 \(float\)"),
    (None, r"prompt must be .*, got None \(NoneType\)"),
])
def test_bad_prompt_is_rejected_naming_index_and_value(llm, prompt, message):
    with pytest.raises(ValueError, match=r"^request 2: " + message):
        llm.generate([GOOD, GOOD, prompt, GOOD], GREEDY, use_tqdm=False)
    assert_idle_and_empty(llm)


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, r"max_tokens=0 is invalid: expected None or an int >= 1"),
    ("max_tokens", -3, r"max_tokens=-3 is invalid"),
    ("max_tokens", 2.5, r"max_tokens=2.5 is invalid"),
    ("temperature", -0.5, r"temperature=-0.5 is invalid: expected a number in \[0, 3.403e\+38\]"),
    ("temperature", float("nan"), r"temperature=nan is invalid"),
    ("temperature", "hot", r"temperature='hot' is invalid"),
])
def test_mutated_sampling_params_are_rechecked(llm, field, value, message):
    bad = SamplingParams(temperature=0, max_tokens=4)
    setattr(bad, field, value)  # SamplingParams checked itself at construction only
    with pytest.raises(ValueError, match=r"^request 1: " + message):
        llm.generate([GOOD, GOOD], [GREEDY, bad], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^request 0: " + message):
        llm.generate([GOOD, GOOD], bad, use_tqdm=False)
    assert_idle_and_empty(llm)


def test_sampling_params_construction_still_checks():
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)


def test_clone_is_a_deep_copy(llm):
    """SamplingParams.clone() (vLLM's): equal, generates the same, and changing the copy's
    stop list or structured_outputs leaves the original as it was."""
    from nanovllm.sampling_params import StructuredOutputsParams
    params = SamplingParams(temperature=0, max_tokens=4, stop=["x"], stop_token_ids=[7],
                            structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("y")
    copy.stop_token_ids[0] = 8
    copy.structured_outputs.choice[0] = "c"
    assert params.stop == ["x"] and params.stop_token_ids == [7]
    assert params.structured_outputs.choice == ["a", "b"]
    plain = GREEDY.clone()
    assert llm.generate([GOOD], plain, use_tqdm=False)[0]["token_ids"] == \
        llm.generate([GOOD], GREEDY, use_tqdm=False)[0]["token_ids"]


def test_malformed_call_is_rejected(llm):
    with pytest.raises(ValueError, match=r"got 1 SamplingParams for 2 prompts"):
        llm.generate([GOOD, GOOD], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match=r"or a list of prompts, got 42 \(int\)"):
        llm.generate(42, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"request 0: sampling params must be a SamplingParams"):
        llm.generate([GOOD], {"temperature": 0}, use_tqdm=False)
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert_idle_and_empty(llm)


def test_use_tqdm_is_a_bool_or_a_bar_factory(llm):
    """As vLLM: use_tqdm=False shows nothing, a callable makes the bar (tqdm's keywords); any
    other value is refused before a request is queued."""
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=rf"use_tqdm={bad!r}: expected a bool or a callable"):
            llm.generate([GOOD], GREEDY, use_tqdm=bad)
    assert_idle_and_empty(llm)
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.n, self.closed = kwargs, 0, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            self.closed = True

    outputs = llm.generate([GOOD, [7, 8, 9]], GREEDY, use_tqdm=Bar)
    assert len(outputs) == 2 and len(bars) == 1
    assert bars[0].kwargs == dict(total=2, desc="Generating", dynamic_ncols=True)  # as vLLM's
    assert bars[0].n == 2 and bars[0].closed


def test_rejected_call_changes_nothing(llm):
    before = llm.generate([GOOD, [7, 8, 9]], GREEDY, use_tqdm=False)
    # The bad request is last: with add-as-you-go the first two would already be queued.
    with pytest.raises(ValueError, match="request 2"):
        llm.generate([GOOD, [7, 8, 9], [600]], GREEDY, use_tqdm=False)
    assert_idle_and_empty(llm)
    after = llm.generate([GOOD, [7, 8, 9]], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in after] == [o["token_ids"] for o in before]


def test_add_request_validates_too(llm):
    with pytest.raises(ValueError, match=r"token id 999"):
        llm.add_request([999], GREEDY)
    assert_idle_and_empty(llm)


def test_request_that_can_never_fit_the_kv_pool(llm):
    prompt = list(range(1, 501))
    # 500 + 13 = 513 tokens; K/V is stored for 512 of them: exactly the pool's 2 blocks.
    fits = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    out = llm.generate([GOOD, prompt], fits, use_tqdm=False)[1]
    assert len(out["token_ids"]) == 13 and out["finish_reason"] == "length"
    too_big = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^request 1: prompt of 500 tokens with max_tokens=14 "
                                         r".* needs 3 KV blocks of 256 tokens, but the KV pool "
                                         r"has only 2"):
        llm.generate([GOOD, prompt], too_big, use_tqdm=False)
    assert_idle_and_empty(llm)


def record_block_tables(llm, monkeypatch) -> list[int]:
    """Wrap the engine's launch hook to record the longest block table of every step."""
    lengths: list[int] = []
    launch = llm._launch

    def recording_launch(seqs, is_prefill, *args):
        lengths.append(max(len(seq.block_table) for seq in seqs))
        return launch(seqs, is_prefill, *args)

    monkeypatch.setattr(llm, "_launch", recording_launch)
    return lengths


def check_stops_at_max_model_len(llm, monkeypatch) -> None:
    max_model_len = llm.config.max_model_len
    lengths = record_block_tables(llm, monkeypatch)
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    prompts = [list(range(1, 501)), [5] * (max_model_len - 1), [3] * 490]
    outs = llm.generate(prompts, long, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert len(prompt) + len(out["token_ids"]) == max_model_len
        assert out["finish_reason"] == "length"
    assert max(lengths) == math.ceil(max_model_len / llm.config.kvcache_block_size)
    assert_idle_and_empty(llm)


def test_sequence_stops_at_max_model_len(tiny_model, monkeypatch):
    # 512 = exactly 2 blocks, so a one-token overrun would need a third block.
    llm = LLM(tiny_model, max_model_len=512, num_kvcache_blocks=4)
    try:
        check_stops_at_max_model_len(llm, monkeypatch)
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_sequence_stops_at_max_model_len_with_cuda_graphs(tiny_model, monkeypatch):
    llm = LLM(tiny_model, max_model_len=512, num_kvcache_blocks=4, max_num_seqs=4,
              enforce_eager=False)
    try:
        assert llm.model_runner.graphs  # decode runs through the captured graphs
        assert llm.model_runner.max_num_blocks == 2  # width of the graphs' block tables
        check_stops_at_max_model_len(llm, monkeypatch)
    finally:
        llm.shutdown()
