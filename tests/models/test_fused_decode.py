"""Decode steps through kernels.fused_linear's projections (fused epilogues, split-K o_proj and
down_proj) give the unfused path's greedy tokens (float16; Triton interpreted on CPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels import fused_linear  # noqa: E402
from nanovllm.utils.dummy_checkpoint import build_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90")
# head_dim 128: the kernels' half heads are whole 64-row MMA tiles
SHAPE = dict(hidden_size=128, head_dim=128, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=256)


# Qwen3MoE: experts in every layer, so only the attention's projections take part
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.fixture(scope="module", params=["Qwen3", "Qwen2", "Qwen3Moe"])
def checkpoint(request, tmp_path_factory) -> str:
    """Qwen3 (q/k norm), Qwen2 (q/k/v biases, no q/k norm) and Qwen3-MoE at sizes the kernels
    tile."""
    extra = MOE if request.param == "Qwen3Moe" else {}
    return build_checkpoint(str(tmp_path_factory.mktemp(request.param)), family=request.param,
                            **SHAPE, **extra)


def _spy(fn, calls: list):
    """fn, appending its name to `calls` on every call."""
    def spy(*args):
        calls.append(fn.__name__)
        return fn(*args)
    return spy


def _fusable(llm: LLM) -> list:
    return [m for m in llm.model_runner.model.modules() if hasattr(m, "fused_decode")]


def _split(llm: LLM) -> list:
    return [m for m in llm.model_runner.model.modules() if hasattr(m, "split_k")]


def test_fused_decode_same_tokens(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy outputs with every decode step fused equal the unfused ones; each fused kernel
    ran once per layer and decode step."""
    llm = LLM(checkpoint, device=DEVICE, attention_backend="triton", dtype="float16",
              enforce_eager=True, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        modules, linears = _fusable(llm), _split(llm)
        mlps = sum(hasattr(m, "gate_up_proj") for m in modules)  # dense MLPs (none with MoE)
        assert len(modules) == 2 + mlps and all(m.can_fuse_decode() for m in modules)
        assert len(linears) == 2 + mlps and all(m.can_split_k() for m in linears)
        assert all(m.fused_decode == (DEVICE == "cuda") for m in modules)
        assert all(m.split_k == (DEVICE == "cuda") for m in linears)
        prompts = [[(7 * i + 3 * j) % 300 + 1 for j in range(n)] for i, n in enumerate((5, 40, 17))]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for m in modules:
            m.fused_decode = False
        for m in linears:
            m.split_k = False
        want = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
        calls = []
        for fn in ("qkv_rope_store", "gate_up_silu", "split_k_linear"):
            monkeypatch.setattr(fused_linear, fn, _spy(getattr(fused_linear, fn), calls))
        for m in modules:
            m.fused_decode = True
        for m in linears:
            m.split_k = True
        got = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want
    # 5 decode steps of the 3 sequences (one batch), 2 layers, each kernel (split-K: o and down)
    assert calls.count("qkv_rope_store") == 5 * 2
    assert calls.count("gate_up_silu") == 5 * mlps
    assert calls.count("split_k_linear") == 5 * (2 + mlps)


def test_can_fuse_decode_rules(checkpoints) -> None:
    """float32 layers and head_dim below 128 keep the unfused path."""
    llm = LLM(checkpoints["untied_gqa4_d64"], device="cpu", dtype="float16",
              num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        modules = _fusable(llm)
        assert modules and not any(m.fused_decode for m in modules)
        attn = [m for m in modules if hasattr(m, "qkv_proj")]
        mlp = [m for m in modules if hasattr(m, "gate_up_proj")]
        assert not any(m.can_fuse_decode() for m in attn)  # head_dim 64
        assert all(m.can_fuse_decode() for m in mlp)  # intermediate 128, float16
    finally:
        llm.shutdown()


def test_can_split_k_rules() -> None:
    """Split-K takes one rank's bias-free, k-major 16-bit weight whose K is whole 128-wide tiles."""
    from nanovllm.layers.linear import RowParallelLinear
    assert RowParallelLinear(256, 128).to(torch.float16).can_split_k()
    assert not RowParallelLinear(256, 128, bias=True).to(torch.float16).can_split_k()
    assert not RowParallelLinear(256, 128).can_split_k()  # float32
    assert not RowParallelLinear(192, 128).to(torch.float16).can_split_k()  # K not whole tiles
