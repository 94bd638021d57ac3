"""Qwen3-MoE on CUDA in float32: greedy tokens equal transformers' with the fused Triton MoE
kernel (eager and CUDA graphs) and with the plain-torch backend (the loop over experts)."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.conftest import MOE_CHECKPOINTS
from tests.models.test_families import prompts
from tests.reference import hf_greedy, load_hf

pytestmark = pytest.mark.gpu
NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("backend, eager", [("triton", True), ("triton", False),
                                            ("torch", False)],
                         ids=["triton-eager", "triton-graphs", "torch"])
@pytest.mark.parametrize("name", list(MOE_CHECKPOINTS))
def test_float32_greedy_matches_transformers(moe_checkpoints, name, backend, eager):
    path, batch = moe_checkpoints[name], prompts()
    llm = LLM(path, attention_backend=backend, enforce_eager=eager, dtype="float32",
              max_num_seqs=16, max_model_len=1024, num_kvcache_blocks=64)
    try:
        assert llm.model_runner.use_cuda_graph == (backend == "triton" and not eager)
        ours = [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    hf = load_hf(path, torch.float32, "cuda")
    assert ours == [hf_greedy(hf, p, NUM_TOKENS) for p in batch]
