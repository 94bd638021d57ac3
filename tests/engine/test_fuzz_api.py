"""Fuzz the public API: any SamplingParams fields and prompts either fail up front with a
ValueError that names the problem, leaving the engine untouched, or produce valid outputs."""
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nanovllm import LLM, SamplingParams

MAX_MODEL_LEN = 16
VOCAB = 512  # the tiny checkpoint's
# What a refusal may say: the field, the request index, or the shape of the call.
ERROR = re.compile(r"^(request \d+: |prompts must be |got \d+ SamplingParams for |"
                   r"\w+=.* is invalid: expected )")

WILD_NUMBERS = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([10**400, 1e-46, 5e-324, 1e39, -0.0, 2**63, 2**31, -1, 0, 1]),
    st.booleans(), st.none(), st.text(max_size=2),
    st.integers(min_value=-2**63, max_value=2**63 - 1).map(np.int64),
    st.floats(width=32).map(np.float32),
    st.floats(allow_nan=True).map(torch.tensor),
    st.integers(min_value=-5, max_value=600).map(torch.tensor),
)


VALID_FIELDS = {
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-46, 1e30]),
    "max_tokens": st.integers(1, 6) | st.sampled_from([10**6, np.int64(3)]),
    "ignore_eos": st.booleans(),
    "top_k": st.sampled_from([-1, 1, 5, 511, 512, 10**6, 2**63, np.int32(3)]),
    "top_p": st.floats(0, 1, exclude_min=True) | st.sampled_from([1e-46, 5e-324]),
    "min_p": st.floats(0, 1) | st.just(1e-46),
    "seed": st.none() | st.integers(0, 2**63 - 1),
    "stop": st.none() | st.text(min_size=1, max_size=3)
    | st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.none() | st.lists(st.integers(0, 2**63 - 1), max_size=3),
}
WILD_VALUES = st.one_of(WILD_NUMBERS, st.lists(WILD_NUMBERS, max_size=2), st.text(max_size=2))


@st.composite
def sampling_fields(draw) -> dict:
    """Valid fields, and in half the draws one of them replaced by anything at all."""
    fields = draw(st.fixed_dictionaries({}, optional=VALID_FIELDS))
    if draw(st.booleans()):
        fields[draw(st.sampled_from(sorted(VALID_FIELDS)))] = draw(WILD_VALUES)
    return fields


TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
VALID_PROMPT = st.one_of(st.text(min_size=1, max_size=20), TOKEN_IDS, TOKEN_IDS.map(tuple),
                         TOKEN_IDS.map(lambda ids: [np.int64(t) for t in ids]))
WILD_PROMPT = st.one_of(
    st.text(max_size=2),
    st.lists(st.integers(0, VOCAB - 1), min_size=MAX_MODEL_LEN - 2, max_size=MAX_MODEL_LEN + 2),
    st.lists(st.one_of(st.integers(0, VOCAB - 1), WILD_NUMBERS), max_size=4),
    TOKEN_IDS.map(np.array), TOKEN_IDS.map(torch.tensor), WILD_NUMBERS,
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
PROMPTS = st.one_of(
    VALID_PROMPT, st.lists(VALID_PROMPT, max_size=3), st.lists(VALID_PROMPT, max_size=3).map(tuple),
    WILD_PROMPT, st.lists(st.one_of(VALID_PROMPT, WILD_PROMPT), min_size=1, max_size=3))


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, num_kvcache_blocks=2, max_model_len=MAX_MODEL_LEN,
                 max_num_batched_tokens=16)
    yield engine
    engine.shutdown()


def engine_state(llm) -> tuple:
    bm = llm.scheduler.block_manager
    return (llm.is_finished(), list(bm.free_block_ids), sorted(bm.used_block_ids),
            dict(bm.hash_to_block_id), bm.num_cache_hit_blocks)


def check_outputs(llm, outputs: list[dict], params_list: list[SamplingParams]) -> None:
    assert len(outputs) == len(params_list)
    for out, params in zip(outputs, params_list):
        ids = out["token_ids"]
        assert all(type(t) is int and 0 <= t < VOCAB for t in ids)
        assert 1 <= len(ids) <= params.max_tokens
        assert out["finish_reason"] in ("stop", "length")
        assert isinstance(out["text"], str)
        assert 0 < out["metrics"]["ttft_s"] <= out["metrics"]["latency_s"]
    assert llm.is_finished() and not llm.scheduler.block_manager.used_block_ids


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fields=st.lists(sampling_fields(), min_size=1, max_size=3), prompts=PROMPTS,
       per_prompt=st.booleans())
def test_any_input_is_served_or_refused_up_front(llm, fields, prompts, per_prompt):
    try:
        params_list = [SamplingParams(**f) for f in fields]
    except ValueError as e:
        assert ERROR.match(str(e)), e
        event("refused by SamplingParams")
        return
    params = params_list if per_prompt else params_list[0]
    before = engine_state(llm)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except ValueError as e:
        assert ERROR.match(str(e)), e
        assert engine_state(llm) == before
        event("refused by generate")
        return
    event("served")
    check_outputs(llm, outputs, params_list if per_prompt else [params] * len(outputs))
