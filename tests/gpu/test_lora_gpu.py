"""LoRA on CUDA: the Triton shrink/expand kernels against the torch reference at Qwen3-0.6B's
shapes, and whole runs with CUDA graphs equal to eager runs and to transformers + peft."""
import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.lora import LoRARequest
from tests.lora.conftest import adapters  # noqa: F401 (the session's adapters fixture)
from tests.lora.helpers import peft_greedy
from tests.reference import ids, token_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("slices,k", [((2048, 1024, 1024), 1024), ((3072, 3072), 1024),
                                      ((1024,), 3072)])
def test_kernels_match_the_reference_on_cuda(slices, k, num_tokens, dtype):
    from nanovllm.kernels.lora import add_lora_triton
    from nanovllm.kernels.lora_torch import add_lora_torch
    from nanovllm.runner.step_inputs import group_by_slot, lora_mapping
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    rank, max_loras = 16, 4
    x = torch.randn(num_tokens, k, device="cuda", generator=g).to(dtype)
    y = torch.randn(num_tokens, sum(slices), device="cuda", generator=g).to(dtype)
    a = (torch.randn(max_loras, len(slices) * rank, k, device="cuda", generator=g)
         / k ** 0.5).to(dtype)
    b = (torch.randn(max_loras, sum(slices), rank, device="cuda", generator=g) * 0.1).to(dtype)
    slots = np.random.default_rng(num_tokens).integers(-1, max_loras, num_tokens)
    packed = torch.from_numpy(group_by_slot(slots, max_loras)).cuda()
    mapping = lora_mapping(packed, num_tokens, max_loras)
    expected, got = y.clone(), y.clone()
    add_lora_torch(expected, x, a, b, slices, mapping)
    add_lora_triton(got, x, a, b, slices, mapping)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_cuda_graphs_equal_eager_and_peft(tiny_model, adapters):  # noqa: F811
    prompts = token_prompts(9, (5, 40, 300))
    names = [None, "all_r4", "qv_rslora", "attn_r8"]
    loras = {n: LoRARequest(n, i, adapters[n]) for i, n in enumerate(names) if n}
    batch = [p for p in prompts for _ in names]
    per_row = [loras.get(n) for _ in prompts for n in names]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(tiny_model, enforce_eager=eager, dtype="float32", attention_backend="triton",
                  enable_lora=True, max_loras=2, max_lora_rank=8, num_kvcache_blocks=64)
        outs[eager] = ids(llm.generate(batch, params, use_tqdm=False, lora_request=per_row))
        assert eager or llm.model_runner.graphs
        llm.shutdown()
    assert outs[True] == outs[False]
    expected = {n: peft_greedy(tiny_model, adapters.get(n), prompts, 16) for n in names}
    assert outs[False] == [expected[n][i] for i in range(len(prompts)) for n in names]
