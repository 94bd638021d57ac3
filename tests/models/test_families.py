"""Qwen2, Llama and Mistral: greedy tokens equal transformers' (float32, CPU), alone and TP=2.

Prompts run to 530 tokens: several 64-token windows, and past the 64 original positions of the
llama3 and yarn RoPE checkpoints.
"""
import random

import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import FAMILY_CHECKPOINTS
from tests.reference import hf_greedy, load_hf

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in (5, 300, 37, 530)]


def hf_tokens(path: str, batch: list[list[int]]) -> list[list[int]]:
    hf = load_hf(path)
    return [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in batch]


def generate(path: str, batch: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(path, num_kvcache_blocks=32, **kwargs)
    try:
        return [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", list(FAMILY_CHECKPOINTS))
def test_greedy_tokens_match_transformers(family_checkpoints, name):
    path, batch = family_checkpoints[name], prompts()
    ours = generate(path, batch)
    assert ours == hf_tokens(path, batch)
    assert len(set(ours[3])) > 3, "degenerate checkpoint: greedy repeats a token"


def test_sliding_window_changes_the_tokens(family_checkpoints):
    """The window matters for these prompts: without it transformers' tokens differ."""
    hf = load_hf(family_checkpoints["mistral_window"])
    long_prompt = prompts()[3]
    windowed = hf_greedy(hf, long_prompt, NUM_TOKENS)
    hf.config.sliding_window = None
    assert hf_greedy(hf, long_prompt, NUM_TOKENS) != windowed


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window"])
def test_sliding_window_over_a_cached_prefix(family_checkpoints, name):
    """A prompt sharing two cached blocks with an earlier one: prefill attends over the paged
    cache within the window, then decode does."""
    path, long_prompt = family_checkpoints[name], prompts()[3]
    second = long_prompt[:512] + [7, 8, 9, 10, 11]
    llm = LLM(path, num_kvcache_blocks=32)
    try:
        llm.generate([long_prompt], GREEDY, use_tqdm=False)
        llm.reset_stats()
        ours = llm.generate([second], GREEDY, use_tqdm=False)[0]["token_ids"]
        assert llm.stats()["cache_hit_blocks"] == 2
    finally:
        llm.shutdown()
    assert ours == hf_tokens(path, [second])[0]


@pytest.mark.parametrize("name", [
    "mistral_window",
    pytest.param("qwen2_yarn", marks=pytest.mark.slow),
    pytest.param("llama3_bias_tied", marks=pytest.mark.slow),
    pytest.param("llama_linear", marks=pytest.mark.slow),
])
def test_tensor_parallel_matches_transformers(family_checkpoints, name):
    """TP=2 over gloo (on CPU, also where a GPU is): sharded heads, biases added once, windows
    and RoPE per rank."""
    path, batch = family_checkpoints[name], prompts(seed=1)[:3]
    assert generate(path, batch, tensor_parallel_size=2, device="cpu") == hf_tokens(path, batch)
