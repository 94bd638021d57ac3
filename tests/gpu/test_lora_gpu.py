"""LoRA on CUDA: the Triton shrink kernel against the torch reference at Qwen3-0.6B's
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
def test_shrink_matches_the_reference_on_cuda(slices, k, num_tokens, dtype):
    from nanovllm.kernels.linear.lora import lora_shrink
    from nanovllm.kernels.linear.lora_reference import lora_shrink_torch
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    rank, max_loras = 16, 4
    x = torch.randn(num_tokens, k, device="cuda", generator=g).to(dtype)
    a = (torch.randn(len(slices), max_loras, rank, k, device="cuda", generator=g)
         / k ** 0.5).to(dtype)
    slots = torch.from_numpy(np.random.default_rng(num_tokens).integers(-1, max_loras,
                                                                        num_tokens))
    slots = slots.to("cuda", torch.int32)
    expected, got = lora_shrink_torch(x, a, slots), lora_shrink(x, a, slots)
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


@pytest.mark.parametrize("num_prompts", [3, 5])
def test_fused_decode_with_lora_equals_unfused_bf16(tmp_path, num_prompts, monkeypatch):
    """bf16, a shape the fused decode projections take (head_dim 128): the decode steps with
    the LoRA expand inside the fused kernels give the unfused path's greedy tokens; 12 rows
    take qkv_proj's and gate_up_proj's shrink from the norm before them, 20 compute it in the
    projections (kernels.linear.lora.AHEAD_MAX_TOKENS)."""
    from benchmarks.random_checkpoints import build_checkpoint
    from nanovllm.layers.backends import bind_backend
    from nanovllm.layers.fused_calibration import layer_class
    from nanovllm.layers.linear import LinearBase
    from tests.lora.helpers import build_adapter
    base = build_checkpoint(str(tmp_path / "base"), dtype="bfloat16", hidden_size=256,
                            intermediate_size=512, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=128)
    names = [None, "a", "b", "c"]
    loras = {n: LoRARequest(n, i, build_adapter(base, str(tmp_path / n), seed=i, r=8))
             for i, n in enumerate(names) if n}
    prompts = token_prompts(num_prompts, (5, 40, 300, 7))
    batch = [p for p in prompts for _ in names]
    per_row = [loras.get(n) for _ in prompts for n in names]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # the fixed limits: the test compares fused with unfused, whatever start-up would measure
    monkeypatch.setenv("NANOVLLM_FUSED_LIMITS", "fixed")
    llm = LLM(base, enforce_eager=True, dtype="bfloat16", attention_backend="triton",
              enable_lora=True, max_loras=4, max_lora_rank=16, num_kvcache_blocks=64)
    runner = llm.model_runner
    projections = [m for m in runner.model.modules()
                   if isinstance(m, LinearBase) and m.lora_a is not None]
    assert all(m.fused_decode_max_tokens > 0 for m in projections)  # LoRA layers run fused
    fused = ids(llm.generate(batch, params, use_tqdm=False, lora_request=per_row))
    bind_backend(runner.model, runner.backend, {layer_class(m): 0 for m in projections})
    plain = ids(llm.generate(batch, params, use_tqdm=False, lora_request=per_row))
    llm.shutdown()
    same = sum(f == p for f, p in zip(fused, plain)) / len(plain)
    assert same >= 0.8, same  # bf16: the fused kernels round the delta once, not twice
    # the adapters change the tokens: rows of each prompt differ from its base row
    assert sum(fused[i] != fused[i - i % 4] for i in range(len(fused)) if i % 4) \
        >= num_prompts + 1
