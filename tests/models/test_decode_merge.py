"""A batch's decode splits merged inside o_proj's split-K kernel (2-16 tokens), not by a launch
of their own: the unfused path's greedy tokens (float16; Triton interpreted on CPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels.attention import decode  # noqa: E402
from nanovllm.kernels.linear import split_k  # noqa: E402
from tests.models import test_fused_decode as fused_decode  # noqa: E402

DEVICE, pytestmark = fused_decode.DEVICE, fused_decode.pytestmark  # sm_90 on CUDA
# test_fused_decode's checkpoints (Qwen3, Qwen2, Qwen3-MoE) and its fixed limits
checkpoint, fixed_limits = fused_decode.checkpoint, fused_decode.fixed_limits


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the split-K launches (+merge: of a PendingMerge) and merge launches, in order."""
    calls = []
    fused_decode.spy_merges(monkeypatch, calls, split_k, "split_k_linear")
    fused_decode.spy_merges(monkeypatch, calls, decode, "reduce_splits")
    return calls


def test_batch_decode_merges_inside_split_k(checkpoint: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences of ~300 tokens (two decode splits each): each step's o_proj merges the
    splits itself (one head a split of K), no merge launch runs, and the tokens are the
    unfused path's."""
    llm = LLM(checkpoint, device=DEVICE, attention_backend="triton", dtype="float16",
              enforce_eager=True, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        prompts = [[(7 * i + 3 * j) % 300 + 1 for j in range(n)]
                   for i, n in enumerate((300, 290, 281))]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        fused_decode._rebind(llm, False)
        want = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
        fused_decode._rebind(llm, True)
        calls = _spy(monkeypatch)
        got = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want
    assert calls.count("split_k_linear+merge") == 5 * 2  # 5 steps, 2 layers' o_proj
    assert "reduce_splits" not in calls
