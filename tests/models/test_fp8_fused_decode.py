"""FP8 models decoding through the fused projections (W8A16: kernels.linear.fused_fp8) against
their unfused path, per output channel and in (128, 128) blocks (CPU: float16, the kernels
interpreted; on CUDA the same, eager; tests/gpu/test_fp8_cuda.py runs them in bf16 with CUDA
graphs).

Two references, because the unfused path as it ships is W8A8 and its activation rounding alone
flips 16-19% of this random model's first decode tokens (measured on CPU when this test was
written; a scale moved to the next channel or block flips 64-98%):
- the unfused path with its W8A8 GEMM swapped for the W8A16 product in both runs (prefill too):
  the same math as the fused kernels, so the greedy tokens agree (measured: all 48 steps, the
  logprobs within 0.012), up to a near tie that a rounding may flip;
- the unfused path as it ships: the first decode step, whose inputs (the prefill's cache and
  first token) both runs share, agrees by statistics (MIN_AGREEMENT, MAX_MEDIAN_DRIFT).
"""
import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.random_checkpoints import build_checkpoint  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels.linear import fp8_gemm  # noqa: E402
from nanovllm.kernels.linear.token_codes import TokenCodes  # noqa: E402
from nanovllm.layers.backends import FastPath, TorchBackend, bind_backend  # noqa: E402
from nanovllm.layers.linear import LinearBase  # noqa: E402
from tests.fp8_checkpoints import quantize_checkpoint, vary_magnitudes  # noqa: E402
from tests.models.test_fused_decode import (  # noqa: E402
    DEVICE,
    SHAPE,  # head_dim 128; with 128-wide blocks, also the scales the fused kernels take
    pytestmark,  # noqa: F401  (its skip applies here too)
    spy_fused_kernels,
)
from tests.reference import token_prompts  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
FIRST_DECODE = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=3)
STATS_PROMPTS = token_prompts(0, tuple(range(3, 3 + 64)))  # one decode batch of 64
# Measured on CPU (float16): 81-84% agree, median drift 0.07-0.10 nats; a scale moved to the
# next channel or block: 2-36% and 2.3-98 nats.
MIN_AGREEMENT, MAX_MEDIAN_DRIFT = 0.6, 0.3
CODES_PROMPTS = token_prompts(2, tuple(range(3, 23)))  # a decode batch of 20: above 16 tokens


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """scheme -> (checkpoint, LLM keywords): per channel (quantization='fp8' over a 16-bit
    checkpoint) and a (128, 128)-block FP8 checkpoint; 128 x 128 tiles of the weights scaled
    apart (tests.fp8_checkpoints.vary_magnitudes), so that every block has its own scale."""
    root = tmp_path_factory.mktemp("fp8_fused")
    src = vary_magnitudes(build_checkpoint(str(root / "src"), **SHAPE), 128)
    block = quantize_checkpoint(src, str(root / "block"), "block", 128)
    return {"channel": (src, {"quantization": "fp8"}), "block": (block, {})}


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 block: tuple[int, int] | None, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The fused kernels' math in torch: the dequantized weight times the 16-bit activations in
    float32, rounded to x's dtype (a backend's fp8_linear, for a W8A16 reference engine; no
    host sync, so CUDA graphs capture it)."""
    n, k = weight.shape
    if block is None:
        dequantized = weight.float() * scale  # [N, 1]: one per output channel
    else:  # each scale broadcast over its block, partial blocks cut at the edges
        rows, cols = scale.shape
        full = scale[:, None, :, None].expand(rows, block[0], cols, block[1])
        dequantized = weight.float() * full.reshape(rows * block[0], cols * block[1])[:n, :k]
    y = x.reshape(-1, k).float() @ dequantized.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_projections(model: nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase) and m.quant is not None]


def assert_same_greedy(fused: list[dict], unfused: list[dict], tol: float) -> None:
    """Greedy runs agree token by token, logprobs within tol, until a step whose two choices
    are a near tie (the fused run's logprobs of both within 2 tol): the rest is not compared,
    its prefixes differ. At least 90% of the steps must be compared."""
    compared = total = 0
    for f, u in zip(fused, unfused, strict=True):
        total += len(u["token_ids"])
        for t_f, t_u, lp_f, lp_u in zip(f["token_ids"], u["token_ids"], f["logprobs"],
                                        u["logprobs"]):
            if t_f != t_u:
                assert t_u in lp_f and lp_f[t_f] - lp_f[t_u] <= 2 * tol, (t_f, t_u, lp_f)
                break
            assert abs(lp_f[t_f] - lp_u[t_u]) <= tol, (t_f, lp_f[t_f], lp_u[t_u])
            compared += 1
    assert compared >= 0.9 * total, f"only {compared} of {total} steps compared"


def first_decode_stats(fused: list[dict], unfused: list[dict]) -> tuple[float, float]:
    """(share of prompts whose first decode token agrees, median |logprob drift| of the
    unfused run's token in the fused run; a token outside the fused top 3 counts at least as
    far as the third)."""
    agree, drift = [], []
    for f, u in zip(fused, unfused, strict=True):
        token, lp_f = u["token_ids"][1], f["logprobs"][1]
        agree.append(f["token_ids"][1] == token)
        drift.append(abs(u["logprobs"][1][token] - lp_f.get(token, min(lp_f.values()))))
    return sum(agree) / len(agree), torch.tensor(drift).median().item()


def _rebind(llm: LLM, fused_projections: bool, gemm=None) -> None:
    """Bind the model again with the fused projections on or off (the torch backend binds them
    off; on CPU they run interpreted), and the FP8 layers' GEMM replaced by `gemm`, if given."""
    backend = llm.model_runner.backend
    model = llm.model_runner.model
    bind_backend(model, type(backend)(replace(backend.fast_path,
                                              fused_projections=fused_projections)))
    for proj in fp8_projections(model):
        assert bool(proj.fused_decode_max_tokens) == fused_projections
        proj.fp8_linear = gemm or proj.fp8_linear


def _engine(model: tuple[str, dict]) -> LLM:
    path, kwargs = model
    return LLM(path, device=DEVICE, attention_backend="torch", dtype="float16",
               enforce_eager=True, num_kvcache_blocks=64, max_num_seqs=64, max_model_len=512,
               **kwargs)


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fused_fp8_decode_is_the_w8a16_product(fp8_models, scheme, monkeypatch) -> None:
    """Against the unfused path computing W8A16 in torch: the same greedy tokens and logprobs;
    each fused kernel ran in every decode step."""
    prompts = token_prompts(1, (5, 40, 17, 9, 23, 3))
    llm = _engine(fp8_models[scheme])
    try:
        _rebind(llm, False, w8a16_linear)
        want = llm.generate(prompts, GREEDY, use_tqdm=False)
        calls = spy_fused_kernels(monkeypatch)
        _rebind(llm, True, w8a16_linear)
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_same_greedy(got, want, tol=0.05)
    # 7 decode steps (one batch), 2 layers; split-K: o_proj and down_proj
    assert sorted(set(calls)) == ["gate_up_silu", "qkv_rope_store", "split_k_linear"]
    assert len(calls) == 7 * 2 * 4


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fused_fp8_decode_agrees_with_the_w8a8_path(fp8_models, scheme) -> None:
    """Against the unfused path as it ships (W8A8): the first decode step agrees as often, and
    drifts as little, as W8A8's activation rounding allows (module docstring)."""
    llm = _engine(fp8_models[scheme])
    try:
        _rebind(llm, False)
        unfused = llm.generate(STATS_PROMPTS, FIRST_DECODE, use_tqdm=False)
        _rebind(llm, True)
        fused = llm.generate(STATS_PROMPTS, FIRST_DECODE, use_tqdm=False)
    finally:
        llm.shutdown()
    agreement, drift = first_decode_stats(fused, unfused)
    assert agreement >= MIN_AGREEMENT and drift <= MAX_MEDIAN_DRIFT, (agreement, drift)


def _spy_token_codes(model: nn.Module) -> list[bool]:
    """The list each FP8 projection's GEMM appends to, from now on: whether it got TokenCodes."""
    handed = []
    for proj in fp8_projections(model):
        def gemm(x, *args, run=proj.fp8_linear, **kwargs):
            handed.append(isinstance(x, TokenCodes))
            return run(x, *args, **kwargs)
        proj.fp8_linear = gemm
    return handed


def test_token_codes_handed_to_fp8_projections_change_nothing(fp8_models, monkeypatch) -> None:
    """Per channel, the fused norms and SiLU-and-mul on (interpreted on CPU), the W8A8 GEMMs
    as they ship: above 16 tokens (the prefill, a decode batch of 20) the two norms and the
    SiLU-and-mul hand qkv_proj, gate_up_proj and down_proj TokenCodes, and the greedy tokens
    and logprobs are exactly those of the projections quantizing their input themselves."""
    llm = _engine(fp8_models["channel"])
    model = llm.model_runner.model
    backend = TorchBackend(FastPath(fused_ops=True))
    backend.fp8_linear, backend.fp8_takes_codes = fp8_gemm.fp8_linear, fp8_gemm.takes_token_codes
    try:
        bind_backend(model, backend)
        handed = _spy_token_codes(model)
        got = llm.generate(CODES_PROMPTS, FIRST_DECODE, use_tqdm=False)
        monkeypatch.setattr(LinearBase, "wants_token_codes", lambda self, num_tokens: False)
        bind_backend(model, backend)
        unhanded = _spy_token_codes(model)
        want = llm.generate(CODES_PROMPTS, FIRST_DECODE, use_tqdm=False)
    finally:
        llm.shutdown()
    # o_proj's input (the attention's output) is the one of four a layer quantized in its GEMM
    assert handed and sum(handed) * 4 == 3 * len(handed) and not any(unhanded)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]
