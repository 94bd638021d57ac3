"""float32 on CUDA is float32: near-tie prompts through a preempting pool give transformers'
exact greedy tokens, and the same run with TF32 attention dots does not (the test's teeth)."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.reference import cache_kwargs, hf_greedy, load_hf

NUM_TOKENS = 40
# Near-ties are chosen at gaps (top-1 minus top-2 logit, over the row's largest |logit|) just
# above FLOOR: float32 rounding (~1e-6 relative) cannot flip them, while TF32's 10-bit mantissas
# (~5e-4 relative per operand) move logits by about that much.
FLOOR = 3e-5
LENGTHS = (200, 225, 250)
CANDIDATES = 48  # per length


@torch.inference_mode()
def greedy_with_gaps(hf, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched greedy continuation of equal-length prompts, and each row's smallest gap."""
    out = hf(prompts, use_cache=True)
    tokens, gaps = [], []
    for _ in range(NUM_TOKENS):
        logits = out.logits[:, -1]
        top2 = logits.topk(2, dim=-1).values
        gaps.append((top2[:, 0] - top2[:, 1]) / logits.abs().max(-1).values)
        tokens.append(logits.argmax(-1))
        out = hf(tokens[-1][:, None], use_cache=True, **cache_kwargs(out))
    return torch.stack(tokens, 1), torch.stack(gaps, 1).min(1).values


@pytest.fixture(scope="module")
def near_ties(tiny_model) -> tuple[list[list[int]], list[list[int]]]:
    """8 prompts of 200-250 tokens whose greedy continuations (transformers, float32, CPU)
    hold the smallest top-1/top-2 gaps above FLOOR among 144 candidates; with their tokens."""
    hf = load_hf(tiny_model)
    gen = torch.Generator().manual_seed(0)
    scored = []
    for length in LENGTHS:
        prompts = torch.randint(1, 500, (CANDIDATES, length), generator=gen)
        tokens, gaps = greedy_with_gaps(hf, prompts)
        scored += [(float(g), p, t) for g, p, t in zip(gaps, prompts.tolist(), tokens.tolist())
                   if g >= FLOOR]
    scored.sort(key=lambda item: item[0])
    chosen = scored[:8]
    print(f"near-tie gaps: {[f'{g:.1e}' for g, _, _ in chosen]}")
    assert all(hf_greedy(hf, p, NUM_TOKENS) == t for _, p, t in chosen)  # batch-invariant
    return [p for _, p, _ in chosen], [t for _, _, t in chosen]


def run_preempting(path: str, prompts: list[list[int]], eager: bool) -> tuple[list, int]:
    """Greedy float32 Triton run in a 5-block pool (the prompts need 16 blocks at once)."""
    llm = LLM(path, attention_backend="triton", dtype="float32", enforce_eager=eager,
              num_kvcache_blocks=5, max_num_seqs=16, max_model_len=1024)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
        return [o["token_ids"] for o in outs], llm.stats()["preemptions"]
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_float32_near_ties_through_preemption_match_transformers(tiny_model, near_ties, eager):
    prompts, expected = near_ties
    got, preemptions = run_preempting(tiny_model, prompts, eager)
    assert preemptions > 0
    assert got == expected


@pytest.mark.gpu
def test_tf32_attention_dots_would_fail_the_test_above(tiny_model, near_ties, monkeypatch):
    """With tl.dot in TF32 (Triton's default for float32) some near-tie row flips."""
    prompts, expected = near_ties
    from nanovllm.kernels.attention import (
        prefill as attention_triton,  # not at collection (TRITON_INTERPRET)
    )
    monkeypatch.setattr(attention_triton, "dot_precision", lambda dtype: "tf32")
    got, _ = run_preempting(tiny_model, prompts, eager=True)
    differing = sum(g != e for g, e in zip(got, expected))
    print(f"TF32 attention: {differing}/{len(prompts)} near-tie rows differ from transformers")
    assert differing > 0
