"""FP8 KV cache end to end on CPU (torch backend): transformers with its K/V rounded the same way
as the reference, and exact invariance under prefix caching, preemption and chunked prefill."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.attention.kv_quant import FP8_DTYPE, dequantize_kv_torch, quantize_kv_torch
from tests.reference import hf_greedy, ids, load_hf, token_prompts

N = 12  # generated tokens per request


def greedy(max_tokens: int = N) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x through an FP8 cache with scale 1.0 and back."""
    return dequantize_kv_torch(quantize_kv_torch(x, 1.0, FP8_DTYPE), 1.0).to(x.dtype)


@pytest.fixture(scope="module")
def hf_fp8(tiny_model):
    """transformers' Qwen3 whose cached K (after RoPE) and V pass through an FP8 cache."""
    from transformers.models.qwen3 import modeling_qwen3
    model = load_hf(tiny_model)
    rope = modeling_qwen3.apply_rotary_pos_emb
    mp = pytest.MonkeyPatch()
    mp.setattr(modeling_qwen3, "apply_rotary_pos_emb",
               lambda q, k, *args, **kw: (lambda qk: (qk[0], fake_quant(qk[1])))(
                   rope(q, k, *args, **kw)))
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: fake_quant(out))
             for layer in model.model.layers]
    yield model
    for hook in hooks:
        hook.remove()
    mp.undo()


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(tiny_model, kv_cache_dtype="fp8", calculate_kv_scales=False,
                 num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


def test_fp8_cache_equals_transformers_with_quantized_kv(tiny_model, llm, hf_fp8):
    """Scale 1.0: greedy tokens equal transformers' whose K/V are rounded to e4m3 as well (and
    differ from a float32 cache's: this checkpoint's near-ties expose any rounding)."""
    runner = llm.model_runner
    assert runner.kv_cache.dtype == FP8_DTYPE
    assert all(a.k_scale == a.v_scale == 1.0 for a in runner.attn_layers)
    prompts = token_prompts(0, (5, 40, 300))
    outs = ids(llm.generate(prompts, greedy(), use_tqdm=False))
    assert outs == [hf_greedy(hf_fp8, p, N) for p in prompts]
    plain = LLM(tiny_model, num_kvcache_blocks=16)
    assert outs != ids(plain.generate(prompts, greedy(), use_tqdm=False))
    plain.shutdown()


def test_prefix_cache_hits_change_nothing(llm):
    """Prefill reads the FP8 cache even without a hit, so a hit gives the same tokens."""
    prompts = token_prompts(1, (300, 600))
    bm = llm.scheduler.block_manager
    first = ids(llm.generate(prompts, greedy(), use_tqdm=False))
    hits = bm.num_cache_hit_blocks
    second = ids(llm.generate(prompts, greedy(), use_tqdm=False))
    assert bm.num_cache_hit_blocks - hits == 1 + 2 and first == second
    shared = token_prompts(2, (512,))[0]
    tails = token_prompts(3, (30,))[0]
    llm.generate([shared + token_prompts(4, (20,))[0]], greedy(), use_tqdm=False)
    hits = bm.num_cache_hit_blocks
    cached = ids(llm.generate([shared + tails], greedy(), use_tqdm=False))
    assert bm.num_cache_hit_blocks - hits == 2
    llm.reset_prefix_cache()
    assert cached == ids(llm.generate([shared + tails], greedy(), use_tqdm=False))


def test_preemption_and_chunked_prefill_change_nothing(tiny_model, llm):
    """A pool too small for the batch (preemption by recompute) and a 100-token budget (chunks
    read earlier chunks from the FP8 cache) give the unconstrained tokens."""
    prompts = token_prompts(5, (200, 220, 240, 260, 280, 300))
    params = greedy(120)
    expected = ids(llm.generate(prompts, params, use_tqdm=False))
    small = LLM(tiny_model, kv_cache_dtype="fp8", calculate_kv_scales=False,
                num_kvcache_blocks=7, max_num_batched_tokens=100)
    try:
        outs = ids(small.generate(prompts, params, use_tqdm=False))
        assert small.scheduler.num_preemptions > 0
        assert small.stats()["prefill_steps"] >= sum(map(len, prompts)) // 100
        assert outs == expected
    finally:
        small.shutdown()


def test_calculated_scales_from_the_warm_up(tiny_model):
    """calculate_kv_scales (the default): per-layer scales = 2 * amax / 448 over the warm-up's
    random batch; prefill logits barely move; a prefix-cache hit changes nothing."""
    engine = LLM(tiny_model, kv_cache_dtype="fp8", num_kvcache_blocks=16)
    try:
        layers = engine.model_runner.attn_layers
        k_scales, v_scales = [a.k_scale for a in layers], [a.v_scale for a in layers]
        # RMS-normed K stays within a few units; V of this random checkpoint reaches ~10-30
        assert all(0.002 < s < 0.05 for s in k_scales), k_scales
        assert all(0.02 < s < 0.5 for s in v_scales), v_scales
        assert len(set(v_scales)) == len(layers)  # one per layer
        prompts = token_prompts(6, (5, 40, 300))
        first = ids(engine.generate(prompts, greedy(1), use_tqdm=False))
        # the first token comes from prefill logits, which FP8 perturbs only slightly
        assert first == [hf[:1] for hf in ids(LLM(tiny_model).generate(
            prompts, greedy(1), use_tqdm=False))]
        again = ids(engine.generate(prompts, greedy(), use_tqdm=False))
        hits = engine.scheduler.block_manager.num_cache_hit_blocks
        assert again == ids(engine.generate(prompts, greedy(), use_tqdm=False))
        assert engine.scheduler.block_manager.num_cache_hit_blocks - hits == 1  # the 300
    finally:
        engine.shutdown()


def test_tensor_parallel_fp8(tiny_model, hf_fp8):
    """TP=2 (gloo): each rank quantizes its own heads; tokens equal the reference's."""
    engine = LLM(tiny_model, kv_cache_dtype="fp8", calculate_kv_scales=False,
                 tensor_parallel_size=2, num_kvcache_blocks=16)
    try:
        prompts = token_prompts(7, (40, 300))
        outs = ids(engine.generate(prompts, greedy(), use_tqdm=False))
        assert outs == [hf_greedy(hf_fp8, p, N) for p in prompts]
    finally:
        engine.shutdown()


def test_fp8_doubles_the_blocks_of_a_bf16_cache(tiny_model):
    """At equal memory (the CPU pool) FP8 blocks are half the bytes: twice as many."""
    counts = {}
    for kv in ("auto", "fp8"):
        engine = LLM(tiny_model, dtype="bfloat16", kv_cache_dtype=kv)
        counts[kv] = engine.model_runner.num_kvcache_blocks
        assert engine.model_runner.kv_cache.element_size() == (1 if kv == "fp8" else 2)
        engine.shutdown()
    assert counts["fp8"] == 2 * counts["auto"]


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(kv_cache_dtype="fp16"), "kv_cache_dtype='fp16'"),
    (dict(kv_cache_dtype=8), "kv_cache_dtype=8"),
    (dict(calculate_kv_scales="yes"), "calculate_kv_scales='yes'"),
    (dict(kv_cache_dtype="fp8", attention_backend="flash-attn"), "flash-attn.*fp8"),
])
def test_config_rejects(tiny_model, kwargs, match):
    """Bad values are named before anything is loaded."""
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model, **kwargs)
