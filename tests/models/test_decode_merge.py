"""A batch's decode splits merged inside o_proj's split-K kernel (2-16 tokens), not by a launch
of their own: the unfused path's greedy tokens (float16; Triton interpreted on CPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from benchmarks.random_checkpoints import build_checkpoint  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels.attention import decode  # noqa: E402
from nanovllm.kernels.attention.pending_merge import PendingMerge  # noqa: E402
from nanovllm.kernels.linear import split_k  # noqa: E402
from tests.models.test_fused_decode import (  # noqa: E402, F401 (pytestmark: sm_90 on CUDA)
    DEVICE,
    MOE,
    SHAPE,
    _rebind,
    pytestmark,
)


@pytest.fixture(scope="module", params=["Qwen3", "Qwen2", "Qwen3Moe"])
def checkpoint(request, tmp_path_factory) -> str:
    """test_fused_decode's checkpoints: Qwen3, Qwen2 and Qwen3-MoE at sizes the kernels tile."""
    extra = MOE if request.param == "Qwen3Moe" else {}
    return build_checkpoint(str(tmp_path_factory.mktemp(request.param)), family=request.param,
                            **SHAPE, **extra)


@pytest.fixture(autouse=True)
def fixed_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed limits, not start-up's measured ones on CUDA (as test_fused_decode)."""
    monkeypatch.setenv("NANOVLLM_FUSED_LIMITS", "fixed")


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the split-K launches (+merge: of a PendingMerge) and merge launches, in order."""
    calls = []

    def spy(module, name):
        fn = getattr(module, name)

        def call(*args, **kwargs):
            calls.append(name + ("+merge" if isinstance(args[0], PendingMerge) else ""))
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, call)
    spy(split_k, "split_k_linear")
    spy(decode, "reduce_splits")
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
        _rebind(llm, False)
        want = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
        _rebind(llm, True)
        calls = _spy(monkeypatch)
        got = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want
    assert calls.count("split_k_linear+merge") == 5 * 2  # 5 steps, 2 layers' o_proj
    assert "reduce_splits" not in calls
