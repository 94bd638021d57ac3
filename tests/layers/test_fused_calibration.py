"""layers.fused_calibration: the limit chosen from timings, one per projection class, and its
binding (steps and timings injected: the CUDA timer is exercised by benchmarks.shapes on a
GPU), and the reduction of the timing graph's replays to seconds per call."""
import pytest
import torch

from benchmarks.random_checkpoints import build_checkpoint
from nanovllm import LLM
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.backends import (
    FUSED_GATE_UP_MAX_TOKENS,
    FastPath,
    TorchBackend,
    bind_backend,
    measures_fused_limits,
)
from nanovllm.layers.fused_calibration import (
    _CALLS_PER_STEP,
    _random_input,
    calibrate,
    choose_max_tokens,
    class_layers,
    decode_step,
    layer_class,
)
from nanovllm.layers.linear import LinearBase, RowParallelLinear
from nanovllm.layers.packed_linear import MergedColumnParallelLinear, QKVParallelLinear
from tests.layers.test_quantization import fp8_projections

SIZES = [2, 3, 4, 6, 8, 16, 64, 128, 256]


@pytest.mark.parametrize(("fused", "unfused", "expected"), [
    ([1] * 9, [2] * 9, 256),  # fused wins everywhere
    ([3] * 9, [2] * 9, 0),  # loses everywhere
    ([1, 1, 1, 1, 1, 1, 3, 3, 3], [2] * 9, 16),  # wins up to 16
    # a lone loss at 3 is outweighed by the wins after it
    ([1, 2.5, 1, 1, 1, 1, 3, 3, 3], [2] * 9, 16),
    ([2] * 9, [2] * 9, 0),  # ties keep the unfused path
])
def test_choose_max_tokens(fused, unfused, expected) -> None:
    assert choose_max_tokens(SIZES, fused, unfused) == expected


def test_fixed_limits_by_env(monkeypatch) -> None:
    monkeypatch.delenv("NANOVLLM_FUSED_LIMITS", raising=False)
    assert measures_fused_limits(FastPath(fused_projections=True))
    assert not measures_fused_limits(FastPath())
    monkeypatch.setenv("NANOVLLM_FUSED_LIMITS", "fixed")
    assert not measures_fused_limits(FastPath(fused_projections=True))


def _wins(proj: LinearBase) -> int:
    """The largest step the fake timer lets each projection's fused kernel win."""
    if isinstance(proj, RowParallelLinear):  # o_proj [128, 256] and down_proj [128, 384]
        return 16 if proj.weight.shape[1] == 256 else 0
    return 64 if isinstance(proj, QKVParallelLinear) else 8


def test_calibrate_binds_one_limit_per_class(tmp_path) -> None:
    """qkv_proj, gate_up_proj, o_proj and down_proj: each class's steps made once per size and
    path and timed in one call, its limit bound to all its layers; o_proj and down_proj (one
    type, two shapes) get their own."""
    path = build_checkpoint(str(tmp_path), hidden_size=128, head_dim=128, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=384)
    llm = LLM(path, device="cpu", dtype="float16", num_kvcache_blocks=4, max_model_len=512)
    try:
        model = llm.model_runner.model
        backend = TorchBackend(FastPath(fused_projections=True))
        bind_backend(model, backend)
        timed: list[list] = []

        made: list[LinearBase] = []

        def make_step(proj: LinearBase, parent, n: int, fused: bool):
            assert parent is not None and proj in list(parent.children())
            made.append(proj)
            return lambda: (proj, n, fused)  # stands for the step: the fake timer calls it

        def time_steps(steps: list) -> list[float]:
            timed.append([step() for step in steps])
            return [(1.0 if n <= _wins(proj) else 3.0) if fused else 2.0
                    for proj, n, fused in timed[-1]]

        limits = calibrate(model, SIZES, time_steps, make_step)
        bind_backend(model, backend, limits)
        kinds = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
        projections = [m for m in model.modules() if type(m) in kinds]
        assert len(limits) == 4 and len(timed) == 1
        steps = timed[0]
        assert len(steps) == 2 * len(SIZES) * 4
        assert len({(layer_class(p), n, f) for p, n, f in steps}) == len(steps)
        assert all(m.fused_decode_max_tokens == _wins(m) for m in projections)
        # every layer of each class made its steps (the tiny model has fewer than the cap)
        assert set(made) == set(projections) and len(projections) > 4
        bind_backend(model, backend)  # without measured limits the fixed ones come back
        assert all(m.fused_decode_max_tokens == FUSED_GATE_UP_MAX_TOKENS for m in projections
                   if isinstance(m, MergedColumnParallelLinear))
    finally:
        llm.shutdown()


def test_calibrate_reads_each_class_slice() -> None:
    """Times come back in the steps' order (class, then size, fused before unfused): each
    class's limit comes from its own slice, whatever the classes before it measured."""
    model = torch.nn.Sequential(RowParallelLinear(256, 128), RowParallelLinear(384, 128))
    limits_by_shape = {(128, 256): 3, (128, 384): 64}
    for module in model:
        module.fused_decode_max_tokens = 1  # bound, as bind_backend would on a GPU
    sizes = [2, 3, 64]

    def time_steps(steps: list) -> list[float]:
        return [(1.0 if n <= limits_by_shape[shape] else 3.0) if fused else 2.0
                for shape, n, fused in (step() for step in steps)]

    limits = calibrate(model, sizes, time_steps,
                       lambda proj, parent, n, fused: lambda: (tuple(proj.weight.shape), n, fused))
    assert limits == {("RowParallelLinear", (128, 256)): 3, ("RowParallelLinear", (128, 384)): 64}


def test_steps_take_the_class_layers_in_turn() -> None:
    """A class's step runs its first _CALLS_PER_STEP layers in turn, a call each, so that a
    timing graph's calls read different weights (not one layer's, from L2 after the first)."""
    model = torch.nn.Sequential(*(RowParallelLinear(256, 128) for _ in range(10)))
    for module in model:
        module.fused_decode_max_tokens = 1
    layers = class_layers(model)[("RowParallelLinear", (128, 256))]
    assert [proj for proj, _ in layers] == list(model)[:_CALLS_PER_STEP]
    assert all(parent is model for _, parent in layers)
    calls: list[torch.nn.Module] = []
    steps = []

    def time_steps(made: list) -> list[float]:
        steps.extend(made)
        return [1.0] * len(made)

    calibrate(model, [2], time_steps, lambda proj, parent, n, fused: lambda: calls.append(proj))
    assert len(steps) == 2  # fused and unfused
    for _ in range(2 * _CALLS_PER_STEP):
        steps[0]()
    assert calls == 2 * list(model)[:_CALLS_PER_STEP]


@pytest.mark.parametrize("fails", [False, True])
def test_calibration_leaves_no_inputs_behind(fails) -> None:
    """The random inputs the class's layers share are dropped once timed, or on an error."""
    model = torch.nn.Sequential(*(RowParallelLinear(256, 128) for _ in range(3)))
    for module in model:
        module.fused_decode_max_tokens = 1

    def time_steps(steps: list) -> list[float]:
        assert _random_input.cache_info().currsize == 2  # x [2, 256] and residual [2, 128]
        if fails:
            raise RuntimeError("capture failed")
        return [1.0] * len(steps)

    if fails:
        with pytest.raises(RuntimeError, match="capture failed"):
            calibrate(model, [2], time_steps)
    else:
        calibrate(model, [2], time_steps)
    assert _random_input.cache_info().currsize == 0


def test_calibration_skips_unbound_layers() -> None:
    """Projections without a fused kernel bound (limit 0) are never timed."""
    model = torch.nn.Sequential(RowParallelLinear(256, 128).to(torch.float16))
    assert calibrate(model, SIZES, lambda steps: pytest.fail("timed an unbound layer"),
                     lambda *a: pytest.fail("made a step of an unbound layer")) == {}


@pytest.mark.parametrize("block", [None, (128, 128)])
@torch.no_grad()
def test_fp8_steps_time_the_layers_own_gemm(block) -> None:
    """For FP8 projections the unfused step is the layer's own linear() (its FP8 GEMM) and the
    fused one the kernel on the codes, in the model's 16-bit dtype; both compute the same step
    (up to W8A8's activation rounding). The Triton kernels run interpreted on CPU."""
    torch.manual_seed(0)
    gate_up, down = fp8_projections(block, torch.float16)[1:]
    for proj in (gate_up, down):
        codes, scales = proj.quant.quantize(torch.randn(proj.weight.shape) * 256 ** -0.5)
        proj.weight.copy_(codes)
        getattr(proj, proj.quant.scale_name).copy_(scales)
    parent = torch.nn.Module()
    parent.act_fn = SiluAndMul()
    model = torch.nn.ModuleList([gate_up, down])
    bind_backend(model, TorchBackend(FastPath(fused_projections=True)))
    gemms = []

    def counted(fp8_linear):
        def gemm(*args):
            gemms.append(args[1].shape)
            return fp8_linear(*args)
        return gemm

    for proj in (gate_up, down):
        proj.fp8_linear = counted(proj.fp8_linear)
        gemms.clear()
        outputs = []
        for fused in (False, True):  # the same random input for both (shared by shape)
            outputs.append(decode_step(proj, parent, 5, fused)())
        _random_input.cache_clear()
        assert gemms == [proj.weight.shape]  # the unfused step's GEMM only
        torch.testing.assert_close(outputs[1], outputs[0], atol=0.1, rtol=0.1)
