"""Qwen3-MoE on CUDA in float32: greedy tokens equal transformers' with the fused Triton MoE
kernel (eager and CUDA graphs) and with the plain-torch backend (the loop over experts)."""
import pytest
import torch

from nanovllm import SamplingParams
from tests.conftest import MOE_CHECKPOINTS
from tests.gpu.test_gpu_families import BACKENDS, float32_engine
from tests.models.test_families import prompts
from tests.reference import hf_greedy, load_hf

pytestmark = pytest.mark.gpu
NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@BACKENDS
@pytest.mark.parametrize("name", list(MOE_CHECKPOINTS))
def test_float32_greedy_matches_transformers(moe_checkpoints, name, backend, eager):
    path, batch = moe_checkpoints[name], prompts()
    llm = float32_engine(path, backend, eager)
    try:
        ours = [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    hf = load_hf(path, torch.float32, "cuda")
    assert ours == [hf_greedy(hf, p, NUM_TOKENS) for p in batch]
