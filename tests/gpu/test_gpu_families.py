"""Qwen2, Llama and Mistral on CUDA in float32: greedy tokens equal transformers' with the
Triton backend (eager and CUDA graphs) and with the plain-torch backend (the GPU reference)."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.conftest import FAMILY_CHECKPOINTS
from tests.models.test_families import prompts
from tests.reference import hf_greedy, load_hf

pytestmark = pytest.mark.gpu
NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def cached_prefix_batch() -> list[list[int]]:
    """The standard prompts, then a second pass sharing the 530-token prompt's first two
    blocks (a prefix-cache hit: prefill attends over cached K/V, windowed for Mistral)."""
    batch = prompts()
    return batch + [batch[3][:512] + [7, 8, 9, 10, 11]]


BACKENDS = pytest.mark.parametrize("backend, eager", [("triton", True), ("triton", False),
                                                     ("torch", False)],
                                   ids=["triton-eager", "triton-graphs", "torch"])


def float32_engine(path: str, backend: str, eager: bool) -> LLM:
    """A small float32 engine on CUDA, checked to capture graphs exactly when it should (the
    torch backend's decode reads lengths on the host: never captured)."""
    llm = LLM(path, attention_backend=backend, enforce_eager=eager, dtype="float32",
              max_num_seqs=16, max_model_len=1024, num_kvcache_blocks=64)
    if llm.model_runner.use_cuda_graph != (backend == "triton" and not eager):
        llm.shutdown()
        raise AssertionError(f"use_cuda_graph wrong for {backend}, eager={eager}")
    return llm


@BACKENDS
@pytest.mark.parametrize("name", list(FAMILY_CHECKPOINTS))
def test_float32_greedy_matches_transformers(family_checkpoints, name, backend, eager):
    path, batch = family_checkpoints[name], cached_prefix_batch()
    llm = float32_engine(path, backend, eager)
    try:
        first = llm.generate(batch[:4], GREEDY, use_tqdm=False)
        llm.reset_stats()
        second = llm.generate(batch[4:], GREEDY, use_tqdm=False)
        assert llm.stats()["cache_hit_blocks"] == 2
    finally:
        llm.shutdown()
    hf = load_hf(path, torch.float32, "cuda")
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in batch]
    assert [o["token_ids"] for o in first + second] == expected
