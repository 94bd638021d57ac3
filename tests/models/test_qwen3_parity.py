"""End-to-end parity with transformers on tiny random Qwen3 checkpoints (float32, CPU)."""
import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.runner.step_inputs import prepare_prefill
from nanovllm.sequence import Sequence
from nanovllm.utils.context import forward_context
from tests.conftest import CHECKPOINTS
from tests.reference import hf_greedy, hf_last_logits, load_hf

NUM_TOKENS = 24


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """A mixed-length batch; two prompts span more than one 256-token block."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in (5, 300, 37, 530, 256)]


@torch.inference_mode()
def prefill_logits(llm: LLM, batch: list[list[int]]) -> torch.Tensor:
    """Each prompt's last-position logits from one prefill step of the whole batch (float32)."""
    runner, block_manager = llm.model_runner, llm.scheduler.block_manager
    seqs = [Sequence(p, SamplingParams(), runner.block_size) for p in batch]
    for seq in seqs:
        block_manager.allocate(seq)
        seq.num_scheduled_tokens = len(seq)  # the whole prompt in one step, as scheduled
    try:
        input_ids, positions, context = prepare_prefill(seqs, runner.block_size, runner.device)
        hidden = runner.forward(input_ids, positions, context)
        with forward_context(context):
            return runner.model.compute_logits(hidden).float().cpu()
    finally:
        for seq in seqs:
            block_manager.deallocate(seq)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def pair(request, checkpoints):
    path = checkpoints[request.param]
    llm = LLM(path, num_kvcache_blocks=64)
    yield llm, load_hf(path)
    llm.shutdown()


def test_greedy_tokens_match_transformers(pair):
    llm, hf = pair
    batch = prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        assert len(out["token_ids"]) == NUM_TOKENS
        assert out["token_ids"] == hf_greedy(hf, prompt, NUM_TOKENS)
    assert len(set(outs[1]["token_ids"])) > 3, "degenerate checkpoint: greedy repeats a token"


def test_prefill_logits_match_transformers(pair):
    llm, hf = pair
    batch = prompts(hf.config.vocab_size, seed=1)
    logits = prefill_logits(llm, batch)
    for i, prompt in enumerate(batch):
        ref = hf_last_logits(hf, prompt)
        rel = (logits[i] - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"prompt {i}: relative error {rel:.2e}"


def test_same_prompt_alone_or_batched_gives_same_tokens(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=32)
    batch = prompts(512, seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = llm.generate(batch, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in batch[:2]]
    assert [o["token_ids"] for o in alone] == [o["token_ids"] for o in together[:2]]
    llm.shutdown()
    assert torch.get_default_dtype() == torch.float32
