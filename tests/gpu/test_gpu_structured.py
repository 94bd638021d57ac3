"""Structured outputs and the steering fields on CUDA (Triton backend, CUDA graphs, pipelined):
greedy tokens equal the CPU engine's in float32, and sampled outputs conform."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams as Structured
from tests.engine.test_structured_outputs import FIVE_PROMPTS, KINDS, PROMPTS, assert_conforms
from tests.reference import token_prompts

pytestmark = pytest.mark.gpu
xgrammar = pytest.importorskip("xgrammar")

STEERED = [dict(logit_bias={345: 100, 383: 90}), dict(allowed_token_ids=list(range(200, 300))),
           dict(min_tokens=8, stop_token_ids=[0, 5, 9]), dict(bad_words=["fox", "hello"])]


def requests() -> tuple[list, list[SamplingParams]]:
    """Every structured kind and every steering field, beside a plain request, greedy."""
    prompts = FIVE_PROMPTS + token_prompts(5, (7, 19, 11, 30)) + PROMPTS[:1]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in KINDS]
    params += [SamplingParams(temperature=0, max_tokens=16, **kw) for kw in STEERED]
    return prompts, params + [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]


def run(path: str, device: str, **kwargs) -> list[list[int]]:
    llm = LLM(path, device=device, dtype="float32", num_kvcache_blocks=64, **kwargs)
    try:
        return [o["token_ids"] for o in llm.generate(*requests(), use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_structured_and_steered_equal_the_cpu_engine(tiny_model, eager):
    expected = run(tiny_model, "cpu")
    got = run(tiny_model, "cuda", attention_backend="triton", enforce_eager=eager)
    assert got == expected


def test_sampled_outputs_conform_on_cuda(tiny_model):
    llm = LLM(tiny_model, device="cuda", attention_backend="triton", num_kvcache_blocks=64)
    try:
        sps = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=40,
                              structured_outputs=s) for i, s in enumerate(KINDS)]
        for s, out in zip(KINDS, llm.generate(FIVE_PROMPTS, sps, use_tqdm=False)):
            assert_conforms(llm, s, out)
        assert torch.cuda.is_available()
    finally:
        llm.shutdown()


def test_n4_json_with_logprobs_conforms(tiny_model):
    llm = LLM(tiny_model, device="cuda", attention_backend="triton", num_kvcache_blocks=64)
    try:
        schema = Structured(json=KINDS[0].json)
        sp = SamplingParams(temperature=0.8, n=4, logprobs=2, max_tokens=40,
                            structured_outputs=schema)
        out = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0]
        assert len(out["outputs"]) == 4
        for completion in out["outputs"]:
            assert_conforms(llm, schema, completion)
    finally:
        llm.shutdown()
