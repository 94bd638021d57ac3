"""Decode steps with each layer as one persistent launch (layers.persistent_decode) give the
per-kernel path's greedy tokens in float32 (Triton interpreted on CPU), and the models it does
not fit keep the per-kernel path."""
import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny interpreter dots: test_attention

import pytest  # noqa: E402

from benchmarks.random_checkpoints import build_checkpoint  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels.persistent import decode_layer  # noqa: E402
from nanovllm.layers.backends import bind_backend  # noqa: E402
from nanovllm.layers.persistent_decode import (  # noqa: E402
    PersistentDecode,
    persistent_decode_mode,
    persistent_fits,
)
from tests.models import test_fp8_fused_decode as fused_fp8  # noqa: E402
from tests.models.test_fp8_fused_decode import fp8_models  # noqa: E402, F401 (a fixture)
from tests.reference import hf_greedy, load_hf, token_prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# sizes the kernel tiles: hidden and intermediate multiples of 128, head_dim 64 or 128
SHAPE = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=400)


@pytest.fixture(scope="module", params=["Qwen3", "Llama"])
def checkpoint(request, tmp_path_factory) -> str:
    """Qwen3 (q/k norm) and Llama (none)."""
    return build_checkpoint(str(tmp_path_factory.mktemp(request.param)), family=request.param,
                            **SHAPE)


def _rebind(llm: LLM, persistent: bool | str) -> None:
    """Bind the model again with the persistent layer on or off, or "auto" (the engine binds
    it only on CUDA when asked: here it runs interpreted, for this test only)."""
    backend = llm.model_runner.backend
    mode = persistent if isinstance(persistent, str) else "on" if persistent else "off"
    fast_path = replace(backend.fast_path, persistent_decode=mode)
    bind_backend(llm.model_runner.model, type(backend)(fast_path))


def _fp8_engine(model: tuple[str, dict]) -> LLM:
    path, kwargs = model
    return LLM(path, device=DEVICE, attention_backend="triton", dtype="float16",
               enforce_eager=True, num_kvcache_blocks=64, max_num_seqs=64, max_model_len=512,
               **kwargs)


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 300 + 1 for j in range(n)] for i, n in enumerate(lengths)]


def _greedy(llm: LLM, lengths: tuple[int, ...]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [out["token_ids"] for out in llm.generate(_prompts(lengths), params, use_tqdm=False)]


@pytest.mark.parametrize("eager,lengths", [
    (True, (5, 40, 17)), (True, (23,)), pytest.param(False, (5, 40, 17), marks=pytest.mark.gpu),
    pytest.param(False, (23,), marks=pytest.mark.gpu)])
def test_same_greedy_tokens_as_the_per_kernel_path(checkpoint, eager, lengths, monkeypatch):
    """float32: every decode step runs one launch a layer and gives the per-kernel path's and
    transformers' tokens exactly (with CUDA graphs on the GPU); a lone sequence carries
    partials between layers."""
    llm = LLM(checkpoint, device=DEVICE, attention_backend="triton", dtype="float32",
              enforce_eager=eager, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        model = llm.model_runner.model
        assert persistent_fits(model.model) and model.model.whole_layer_decode is None
        _rebind(llm, False)
        want = _greedy(llm, lengths)
        carried = []  # each launch's carry_out
        launch = decode_layer.PersistentDecodeLayer.__call__

        def spy(self, *args, **kwargs):
            carried.append(kwargs.get("carry_out", False))
            return launch(self, *args, **kwargs)
        monkeypatch.setattr(decode_layer.PersistentDecodeLayer, "__call__", spy)
        _rebind(llm, True)
        if not eager:  # the graphs captured at start-up ran the per-kernel path
            llm.model_runner.capture_cudagraph()
        assert isinstance(model.model.whole_layer_decode, PersistentDecode)
        got = _greedy(llm, lengths)
    finally:
        llm.shutdown()
    assert got == want
    hf = load_hf(checkpoint, device=DEVICE)  # and transformers' own greedy tokens
    assert got == [hf_greedy(hf, prompt, 6) for prompt in _prompts(lengths)]
    if eager:  # 5 decode steps of one batch, 2 layers
        assert carried == ([True, False] * 5 if len(lengths) == 1 else [False] * 10)
    else:  # launched when captured (replays launch no Python): the graph of 2 tokens carries
        assert True in carried and False in carried


def test_sleep_frees_the_scratch_and_wake_up_decodes_the_same(checkpoint):
    """sleep() drops the persistent layer's scratch with the KV pool; after wake_up the next
    step makes it again and decodes what it did before."""
    llm = LLM(checkpoint, device=DEVICE, attention_backend="triton", dtype="float32",
              enforce_eager=True, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        _rebind(llm, True)
        whole = llm.model_runner.model.model.whole_layer_decode
        before = _greedy(llm, (23,))
        assert whole.kernel is not None
        llm.sleep(1)
        assert whole.kernel is None
        llm.wake_up()
        assert _greedy(llm, (23,)) == before and whole.kernel is not None
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family,fields", [
    ("Qwen2", {}),  # q/k/v biases
    ("Qwen3Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)),
    ("Mistral", dict(sliding_window=64)),
    ("Qwen3", dict(hidden_size=192)),  # not a multiple of 128
])
def test_models_it_does_not_fit_keep_the_per_kernel_path(family, fields, tmp_path):
    path = build_checkpoint(str(tmp_path), family=family, **{**SHAPE, **fields})
    llm = LLM(path, device="cpu", num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        model = llm.model_runner.model.model
        assert not persistent_fits(model)
        _rebind(llm, True)
        assert model.whole_layer_decode is None
    finally:
        llm.shutdown()


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fp8_models_give_the_w8a16_products_tokens(fp8_models, scheme, monkeypatch):  # noqa: F811
    """FP8 weights (per channel: quantization='fp8'; 128 x 128 blocks: a block checkpoint),
    float16: the persistent layers against the per-kernel path computing W8A16 in torch, the
    same greedy tokens and logprobs (tests.models.test_fp8_fused_decode's comparison)."""
    prompts = token_prompts(1, (5, 40, 17, 9, 23, 3))
    llm = _fp8_engine(fp8_models[scheme])
    try:
        fused_fp8._rebind(llm, False, fused_fp8.w8a16_linear)
        want = llm.generate(prompts, fused_fp8.GREEDY, use_tqdm=False)
        _rebind(llm, True)
        for proj in fused_fp8.fp8_projections(llm.model_runner.model):  # prefill: W8A16 too
            proj.fp8_linear = fused_fp8.w8a16_linear
        assert isinstance(llm.model_runner.model.model.whole_layer_decode, PersistentDecode)
        got = llm.generate(prompts, fused_fp8.GREEDY, use_tqdm=False)
        lone = llm.generate(prompts[:1], fused_fp8.GREEDY, use_tqdm=False)  # carried partials
    finally:
        llm.shutdown()
    fused_fp8.assert_same_greedy(got, want, tol=0.05)
    fused_fp8.assert_same_greedy(lone, want[:1], tol=0.05)


@pytest.mark.parametrize("value,mode", [("", "off"), ("0", "off"), ("off", "off"), ("1", "on"),
                                        ("on", "on"), ("auto", "auto"), (" Auto ", "auto")])
def test_the_switch_takes_off_on_and_auto(value, mode):
    assert persistent_decode_mode(value) == mode


@pytest.mark.parametrize("value", ["2", "yes", "measured"])
def test_a_bad_switch_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=f"NANOVLLM_PERSISTENT_DECODE='{value}'"):
        persistent_decode_mode(value)


def test_auto_runs_no_eager_step_until_a_graph_measures_it(checkpoint, monkeypatch):
    """Measured ("auto"), the layer is bound but off: eager steps run the per-kernel path,
    since only a captured graph is timed both ways (runner.cuda_graphs)."""
    launches = []
    launch = decode_layer.PersistentDecodeLayer.__call__
    monkeypatch.setattr(decode_layer.PersistentDecodeLayer, "__call__",
                        lambda self, *a, **k: launches.append(1) or launch(self, *a, **k))
    llm = LLM(checkpoint, device=DEVICE, attention_backend="triton", dtype="float32",
              enforce_eager=True, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)
    try:
        _rebind(llm, "auto")
        whole = llm.model_runner.model.model.whole_layer_decode
        assert whole.measured and not whole.enabled
        _greedy(llm, (5, 9))
        assert not launches
        whole.enabled = True  # what a graph measured faster captures
        _greedy(llm, (5, 9))
        assert launches
    finally:
        llm.shutdown()


@pytest.mark.parametrize("times,runs,kept", [
    ([2.0, 1.0], True, "per-kernel"), ([1.0, 2.0], True, "persistent"),
    ([0.99, 1.0], True, "per-kernel"),  # within PERSISTENT_MARGIN: the reference stays
    (None, False, "persistent")])  # the layer declined the step: one capture, nothing timed
def test_capture_keeps_the_faster_variant_timed_over_real_lengths(times, runs, kept,
                                                                  monkeypatch):
    """_faster_variant captures the step with the layer on, then off, times both with every
    sequence at TIMING_CONTEXT keys over blocks of its own (no slot written), keeps the
    persistent graph only when PERSISTENT_MARGIN faster, and leaves the buffers' lengths and
    tables zero again; a step the layer never ran is captured once."""
    from nanovllm.runner import cuda_graphs
    whole = PersistentDecode(measured=True)
    step = cuda_graphs._decode_inputs(3, 4, 0, torch.device("cpu"))
    context = step[1][3]
    seen = {"pools": [], "graphs": []}

    class Graph(str):  # a graph's name, and the pool the next capture shares
        def pool(self):
            return "pool"

    def capture(model, step, outputs, pool):
        seen["pools"].append(pool)
        whole.launches += whole.enabled and runs  # what PersistentDecode.__call__ counts
        return Graph("persistent" if whole.enabled else "per-kernel")

    def replay(graphs, rounds):
        seen.update(graphs=graphs, lens=context.context_lens.tolist(),
                    tables=context.block_tables.tolist(), slots=context.slot_mapping.tolist())
        return times
    monkeypatch.setattr(cuda_graphs, "_capture", capture)
    monkeypatch.setattr(cuda_graphs, "replay_times", replay)
    graph, ms = cuda_graphs._faster_variant(None, step, None, None, whole, (5, 256))
    assert graph == kept and ms == (tuple(times) if runs else None)
    assert context.context_lens.tolist() == [0] * 3 and not context.block_tables.any()
    if not runs:
        assert seen["pools"] == [None] and not seen["graphs"]
        return
    assert seen["graphs"] == ["persistent", "per-kernel"] and seen["pools"] == [None, "pool"]
    assert seen["lens"] == [cuda_graphs.TIMING_CONTEXT] * 3 and seen["slots"] == [-1] * 3
    assert seen["tables"] == [[0, 1, 0, 0], [2, 3, 0, 0], [4, 0, 0, 0]]  # 6 blocks of 5


@pytest.mark.gpu
def test_auto_keeps_a_measured_graph_per_size_and_its_tokens(checkpoint, monkeypatch):
    """NANOVLLM_PERSISTENT_DECODE=auto on the GPU: every graph of <= 16 tokens is timed both
    ways at capture, and the greedy tokens (float32) are the per-kernel path's."""
    kwargs = dict(device=DEVICE, attention_backend="triton", dtype="float32",
                  num_kvcache_blocks=16, max_num_seqs=16, max_model_len=512)
    llm = LLM(checkpoint, **kwargs)
    try:
        want = _greedy(llm, (5, 40, 17, 23, 3))
        lone = _greedy(llm, (23,))
    finally:
        llm.shutdown()
    monkeypatch.setenv("NANOVLLM_PERSISTENT_DECODE", "auto")
    llm = LLM(checkpoint, **kwargs)
    try:
        runner = llm.model_runner
        assert sorted(runner.persistent_decode_ms) == sorted(b for b in runner.graphs if b <= 16)
        assert all(p > 0 and k > 0 for p, k in runner.persistent_decode_ms.values())
        assert _greedy(llm, (5, 40, 17, 23, 3)) == want and _greedy(llm, (23,)) == lone
    finally:
        llm.shutdown()
