"""Parity with transformers on CUDA, per attention backend, with and without CUDA graphs."""
import importlib.util
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.models.test_qwen3_parity import prefill_logits
from tests.reference import hf_greedy, hf_last_logits, load_hf

pytestmark = pytest.mark.gpu
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
NUM_TOKENS = 32


def batch(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in (7, 300, 45, 600, 256, 1)]


def run_greedy(path: str, backend: str, eager: bool, dtype: str) -> list[list[int]]:
    llm = LLM(path, attention_backend=backend, enforce_eager=eager, dtype=dtype,
              max_num_seqs=16, max_model_len=1024, num_kvcache_blocks=64)
    outs = llm.generate(batch(512), SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [o["token_ids"] for o in outs]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_triton_float32_greedy_matches_transformers(tiny_model, eager):
    hf = load_hf(tiny_model, torch.float32, "cuda")
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in batch(512)]
    assert run_greedy(tiny_model, "triton", eager, "float32") == expected


@pytest.mark.skipif(not HAS_FLASH, reason="flash-attn not importable")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_flash_attn_bf16_greedy_matches_transformers(tiny_model, eager):
    """FlashAttention has no float32 kernels, so this backend is checked in bf16.

    bf16 rounding differs between any two implementations, so exact token equality over 32
    steps is not a fair bar; instead every token we pick must be transformers' argmax up to a
    bf16-sized margin when transformers is teacher-forced along our sequence.
    """
    hf = load_hf(tiny_model, torch.bfloat16, "cuda")
    got = run_greedy(tiny_model, "flash-attn", eager, "bfloat16")
    exact = 0
    for prompt, tokens in zip(batch(512), got):
        with torch.inference_mode():
            ids = torch.tensor([prompt + tokens], device="cuda")
            logits = hf(ids).logits[0, len(prompt) - 1:-1].float()  # predicts each new token
        best = logits.max(-1).values
        picked = logits.gather(-1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        margin = 0.02 * logits.abs().max(-1).values  # ~ a few bf16 ulps of the logit scale
        assert bool(((best - picked) <= margin).all()), (prompt[:4], tokens)
        exact += int((logits.argmax(-1) == torch.tensor(tokens, device="cuda")).sum())
    print(f"flash-attn bf16 {'eager' if eager else 'graphs'}: {exact}/{NUM_TOKENS * len(got)}"
          " tokens are transformers' exact argmax")


def test_graphs_equal_eager_for_every_backend(tiny_model):
    backends = ["triton"] + (["flash-attn"] if HAS_FLASH else [])
    for backend in backends:
        dtype = "float16" if backend == "flash-attn" else "float32"
        assert (run_greedy(tiny_model, backend, True, dtype)
                == run_greedy(tiny_model, backend, False, dtype)), backend


@pytest.mark.parametrize("backend", ["triton", "flash-attn"])
def test_qwen3_0_6b_shape_bf16_prefill_logits(backend):
    if backend == "flash-attn" and not HAS_FLASH:
        pytest.skip("flash-attn not importable")
    from benchmarks.random_checkpoints import qwen3_0_6b_random
    path = qwen3_0_6b_random()
    llm = LLM(path, attention_backend=backend, max_model_len=2048, num_kvcache_blocks=64)
    prompts = batch(151936, seed=3)[:4]
    logits = prefill_logits(llm, prompts)
    llm.shutdown()
    hf = load_hf(path, torch.bfloat16, "cuda")
    worst = 0.0
    for i, p in enumerate(prompts):
        ref = hf_last_logits(hf, p)
        worst = max(worst, float((logits[i] - ref).abs().max() / ref.abs().max()))
    print(f"{backend}: Qwen3-0.6B-shape bf16 prefill logits, max relative error {worst:.3e}")
    assert worst < 3e-2


def test_shutdown_frees_gpu_memory_and_a_new_engine_works(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    import gc
    gc.collect()
    before = torch.cuda.memory_allocated()  # earlier tests' tensors (e.g. cached helpers)
    llm = LLM(tiny_model, max_model_len=1024, max_num_seqs=16)
    assert torch.cuda.memory_allocated() > before + (1 << 30)  # the KV pool fills the GPU
    first = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]["token_ids"]
    del llm  # no explicit shutdown: the finalizer must release the pool and graphs
    gc.collect()
    torch.cuda.empty_cache()
    leaked = torch.cuda.memory_allocated() - before
    assert leaked < 16 << 20, leaked
    llm = LLM(tiny_model, max_model_len=1024, max_num_seqs=16)
    assert llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]["token_ids"] == first
    llm.shutdown()
