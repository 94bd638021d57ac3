"""Decode steps through kernels.linear.fused's projections (fused epilogues, split-K o_proj and
down_proj) give the unfused path's greedy tokens (float16; Triton interpreted on CPU)."""
import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.random_checkpoints import build_checkpoint  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels.attention import decode  # noqa: E402
from nanovllm.kernels.attention.pending_merge import PendingMerge  # noqa: E402
from nanovllm.kernels.linear import fused as fused_linear  # noqa: E402
from nanovllm.kernels.linear import (  # noqa: E402
    fused_gate_up,
    gemv,
    gemv_gate_up,
    gemv_mlp,
    split_k,
)
from nanovllm.layers.backends import (  # noqa: E402
    FUSED_GATE_UP_MAX_TOKENS,
    FUSED_QKV_MAX_TOKENS,
    FUSED_SPLIT_K_MAX_TOKENS,
    FastPath,
    TorchBackend,
    bind_backend,
)
from nanovllm.layers.linear import RowParallelLinear  # noqa: E402
from nanovllm.layers.packed_linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
)
from nanovllm.utils.context import Context, forward_context  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90")
# head_dim 128: the kernels' half heads are whole 64-row MMA tiles
SHAPE = dict(hidden_size=128, head_dim=128, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=256)
# each projection with a fused decode kernel, and the largest decode step that runs it
LIMITS = {QKVParallelLinear: FUSED_QKV_MAX_TOKENS,
          MergedColumnParallelLinear: FUSED_GATE_UP_MAX_TOKENS,
          RowParallelLinear: FUSED_SPLIT_K_MAX_TOKENS}


# Qwen3MoE: experts in every layer, so only the attention's projections take part
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.fixture(scope="module", params=["Qwen3", "Qwen2", "Qwen3Moe"])
def checkpoint(request, tmp_path_factory) -> str:
    """Qwen3 (q/k norm), Qwen2 (q/k/v biases, no q/k norm) and Qwen3-MoE at sizes the kernels
    tile."""
    extra = MOE if request.param == "Qwen3Moe" else {}
    return build_checkpoint(str(tmp_path_factory.mktemp(request.param)), family=request.param,
                            **SHAPE, **extra)


@pytest.fixture(autouse=True)
def fixed_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed limits (LIMITS) these tests assert, not start-up's measured ones on CUDA
    (tests/layers/test_fused_calibration.py)."""
    monkeypatch.setenv("NANOVLLM_FUSED_LIMITS", "fixed")


def spy_fused_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The list each fused decode kernel appends its name to when it runs (from now on)."""
    calls = []

    def spy(fn):
        def call(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return call
    for name in ("qkv_rope_store", "gate_up_silu", "split_k_linear"):
        module = {"split_k_linear": split_k, "gate_up_silu": fused_gate_up}.get(name,
                                                                                fused_linear)
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
    return calls


def spy_merges(monkeypatch: pytest.MonkeyPatch, calls: list[str], module, name: str) -> None:
    """module.name appends its name to calls when it runs (+merge: on a PendingMerge)."""
    fn = getattr(module, name)

    def call(*args, **kwargs):
        calls.append(name + ("+merge" if isinstance(args[0], PendingMerge) else ""))
        return fn(*args, **kwargs)
    monkeypatch.setattr(module, name, call)


def spy_gemv(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The list the one-token GEMVs append their names to, as split_k and fused call them."""
    calls = []
    for module, name in (
            (split_k, "gemv_partials"),
            (fused_gate_up, "gate_up_silu_gemv"),  # kernels.linear.fused_gate_up's name for it
            # qkv_rope_store's (backends without can_decode_new_token)
            (fused_linear, "gemv_rows"),
            (gemv, "gemv_rows"),  # LinearBase.gemv_rows: Triton's decode takes the raw q, k, v
            (gemv_gate_up, "norm_gate_up_silu_gemv"),
            (gemv_mlp, "gate_up_down_gemv"),  # the whole MLP in one kernel
            (gemv, "norm_gemv_rows"),  # QKVParallelLinear.norm_gemv_rows: the input norm inside
            (decode, "reduce_splits")):  # the splits' merge launch (o_proj's GEMV merges instead)
        spy_merges(monkeypatch, calls, module, name)
    return calls


def _projections(model: nn.Module) -> list:
    """The model's projections that have a fused decode kernel."""
    return [m for m in model.modules() if type(m) in LIMITS]


def _rebind(llm: LLM, fused_projections: bool, **fast_path_fields) -> None:
    """Bind the model again, to a backend of its kind with the fused projections on or off (on
    CPU the engine binds them off: they run here interpreted, for this test only)."""
    backend = llm.model_runner.backend
    fast_path = replace(backend.fast_path, fused_projections=fused_projections,
                        **fast_path_fields)
    bind_backend(llm.model_runner.model, type(backend)(fast_path))


def test_fused_decode_same_tokens(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy outputs with every decode step fused equal the unfused ones; each fused kernel
    ran once per layer and decode step."""
    llm = LLM(checkpoint, device=DEVICE, attention_backend="triton", dtype="float16",
              enforce_eager=True, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        projections = _projections(llm.model_runner.model)
        mlps = sum(isinstance(m, MergedColumnParallelLinear) for m in projections)  # no MoE's
        assert len(projections) == 2 * (2 + mlps) and all(m.fits_fused_decode()
                                                          for m in projections)
        bound = DEVICE == "cuda"  # the engine's own choice: sm_90 (see pytestmark)
        assert all(m.fused_decode_max_tokens == (LIMITS[type(m)] if bound else 0)
                   for m in projections)
        prompts = [[(7 * i + 3 * j) % 300 + 1 for j in range(n)] for i, n in enumerate((5, 40, 17))]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        _rebind(llm, False)
        assert not any(m.fused_decode_max_tokens for m in projections)
        want = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
        fused_calls = spy_fused_kernels(monkeypatch)
        _rebind(llm, True)
        assert all(m.fused_decode_max_tokens == LIMITS[type(m)] for m in projections)
        got = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
        calls = list(fused_calls)  # the three sequences' steps
        # a lone sequence: its projections run kernels.linear.gemv (no LoRA here)
        gemv_calls = spy_gemv(monkeypatch)
        # 300 tokens: a table of 2 blocks, 2 decode splits
        lone = [[(11 * j) % 300 + 1 for j in range(300)]]
        got_one = llm.generate(lone, params, use_tqdm=False)[0]["token_ids"]
        gemv_calls = list(gemv_calls)  # its steps' (the unfused ones' merge launches not)
        _rebind(llm, False)
        want_one = llm.generate(lone, params, use_tqdm=False)[0]["token_ids"]
    finally:
        llm.shutdown()
    assert got == want and got_one == want_one
    # o_proj, each layer: the decode's 2 splits merged inside its GEMV, no merge launch
    assert gemv_calls.count("gemv_partials+merge") == 5 * 2 and "reduce_splits" not in gemv_calls
    # the MLP in one kernel: gate_up_proj with the norm before it (o_proj's partials summed
    # in its programs) and down_proj (2 dense layers take turns; test_one_token_mlp)
    assert gemv_calls.count("gate_up_down_gemv") == 5 * mlps
    assert gemv_calls.count("gemv_partials") == gemv_calls.count("norm_gate_up_silu_gemv") == 0
    assert gemv_calls.count("gate_up_silu_gemv") == 0
    # qkv_proj: 5 steps, 2 layers; layer 1's with its input norm after a dense layer 0
    chained = 5 if mlps else 0
    assert gemv_calls.count("norm_gemv_rows") == chained
    assert gemv_calls.count("gemv_rows") == 5 * 2 - chained
    # ... its q/k norm, RoPE and K/V write inside the Triton decode kernel (new_token)
    assert "qkv_rope_store" not in fused_calls[len(calls):]
    # 5 decode steps of the 3 sequences (one batch), 2 layers, each kernel (split-K: o and down)
    assert calls.count("qkv_rope_store") == 5 * 2
    assert calls.count("gate_up_silu") == 5 * mlps
    assert calls.count("split_k_linear") == 5 * (2 + mlps)


def test_lone_token_decodes_its_new_token_at_any_qkv_limit(checkpoint: str,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A lone token takes qkv_proj's GEMV into the decode kernel even where start-up measured
    qkv_proj's fused kernel slower at every size (limit 0): that kernel does not run there."""
    llm = LLM(checkpoint, device=DEVICE, attention_backend="triton", dtype="float16",
              enforce_eager=True, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        prompt = [[(5 * j) % 300 + 1 for j in range(23)]]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        _rebind(llm, False)
        want = llm.generate(prompt, params, use_tqdm=False)[0]["token_ids"]
        _rebind(llm, True)
        for module in _projections(llm.model_runner.model):
            if isinstance(module, QKVParallelLinear):
                module.fused_decode_max_tokens = 0
        calls = spy_gemv(monkeypatch)
        got = llm.generate(prompt, params, use_tqdm=False)[0]["token_ids"]
    finally:
        llm.shutdown()
    assert got == want  # 5 steps, 2 layers; layer 1's qkv_proj with its input norm if dense
    assert calls.count("gemv_rows") + calls.count("norm_gemv_rows") == 5 * 2


# case -> (family, config fields, the layers whose qkv_proj GEMV takes their input norm): three
# Qwen3 layers whose down_proj leaves 2 partials (K 1,024), norms inside layers 1 and 2; three
# Qwen3-MoE layers, sparse, dense (mlp_only_layers), sparse: the sparse layer 0 hands its
# successor a tensor, the dense layer 1 a PendingNorm to the sparse layer 2
INPUT_NORM_CASES = {"qwen3": ("Qwen3", dict(intermediate_size=1024, num_hidden_layers=3), 2),
                    "moe": ("Qwen3Moe", dict(MOE, num_hidden_layers=3, mlp_only_layers=[1]), 1)}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", list(INPUT_NORM_CASES))
def test_lone_token_input_norm_inside_qkv_gemv(case: str, backend: str, tmp_path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone token's layers after a dense MLP take their input norm inside qkv_proj's GEMV
    (INPUT_NORM_CASES), the last layer ends in the final norm as before. The greedy tokens
    equal the path with that fusion off, and on CPU (the norm kernel interpreted too) their
    logprobs bit for bit; the unfused path's tokens too. Triton's decode takes the GEMV's q, k,
    v raw (new_token); torch's, after the q/k norm and RoPE."""
    family, fields, normed = INPUT_NORM_CASES[case]
    path = build_checkpoint(str(tmp_path), family=family, **{**SHAPE, **fields})
    llm = LLM(path, device=DEVICE, attention_backend=backend, dtype="float16",
              enforce_eager=True, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    prompt = [[(11 * j) % 300 + 1 for j in range(19)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    try:
        _rebind(llm, False)
        unfused = llm.generate(prompt, params, use_tqdm=False)[0]
        _rebind(llm, True, fused_ops=True)
        calls = spy_gemv(monkeypatch)
        got = llm.generate(prompt, params, use_tqdm=False)[0]
        on = list(calls)
        monkeypatch.setattr(QKVParallelLinear, "runs_norm_gemv_rows", lambda *_: False)
        want = llm.generate(prompt, params, use_tqdm=False)[0]
        off = calls[len(on):]
    finally:
        llm.shutdown()
    # 5 decode steps: layer 0's qkv_proj from the model's own norm, the others' as the case says
    assert on.count("norm_gemv_rows") == 5 * normed and on.count("gemv_rows") == 5 * (3 - normed)
    assert off.count("norm_gemv_rows") == 0 and off.count("gemv_rows") == 5 * 3
    assert got["token_ids"] == want["token_ids"] == unfused["token_ids"]
    assert len(got["logprobs"]) == len(got["token_ids"])
    if DEVICE == "cpu":
        assert got["logprobs"] == want["logprobs"]


def test_fits_fused_decode_rules(checkpoints) -> None:
    """float32 layers and head_dim below 128 keep the unfused path."""
    llm = LLM(checkpoints["untied_gqa4_d64"], device="cpu", dtype="float16",
              num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        projections = _projections(llm.model_runner.model)
        assert projections and not any(m.fused_decode_max_tokens for m in projections)
        qkv = [m for m in projections if isinstance(m, QKVParallelLinear)]
        gate_up = [m for m in projections if isinstance(m, MergedColumnParallelLinear)]
        assert qkv and not any(m.fits_fused_decode() for m in qkv)  # head_dim 64
        assert gate_up and all(m.fits_fused_decode() for m in gate_up)  # intermediate 128
    finally:
        llm.shutdown()


def test_split_k_rules() -> None:
    """Split-K takes one rank's bias-free, k-major 16-bit weight whose K is whole 128-wide tiles."""
    assert RowParallelLinear(256, 128).to(torch.float16).fits_fused_decode()
    assert not RowParallelLinear(256, 128, bias=True).to(torch.float16).fits_fused_decode()
    assert not RowParallelLinear(256, 128).fits_fused_decode()  # float32
    assert not RowParallelLinear(192, 128).to(torch.float16).fits_fused_decode()  # K: 1.5 tiles


@torch.no_grad()
def test_row_parallel_forward_one_type_when_split_k_bound() -> None:
    """forward returns [tokens, output] in the activation dtype even in a decode step bound to
    split-K; split_k_partials is the separate float32 [S, tokens, output] operation."""
    torch.manual_seed(0)
    proj = RowParallelLinear(256, 128).to(device=DEVICE, dtype=torch.float16)
    proj.weight.normal_(0.0, 256 ** -0.5)
    bind_backend(proj, TorchBackend(FastPath(fused_projections=True)))
    assert proj.fused_decode_max_tokens == FUSED_SPLIT_K_MAX_TOKENS
    x = torch.randn(5, 256, device=DEVICE).to(torch.float16)
    slots = torch.arange(5, device=DEVICE)
    with forward_context(Context(is_prefill=False, slot_mapping=slots)):
        assert proj.runs_fused_decode(x)
        y = proj(x)
        parts = proj.split_k_partials(x)
    assert y.dtype == torch.float16 and y.shape == (5, 128)
    assert torch.equal(y, F.linear(x, proj.weight))
    assert parts.dtype == torch.float32 and parts.dim() == 3 and parts.shape[1:] == (5, 128)
    torch.testing.assert_close(parts.sum(0), F.linear(x.float(), proj.weight.float()),
                               atol=1e-3, rtol=1e-3)
    # prefill, a step that writes no cache, or more tokens than the limit: never split
    for ctx, tokens in ((Context(is_prefill=True, slot_mapping=slots), 5), (Context(), 5),
                        (Context(slot_mapping=slots), FUSED_SPLIT_K_MAX_TOKENS + 1)):
        with forward_context(ctx):
            assert not proj.runs_fused_decode(torch.empty(tokens, 256))
