"""A lone token's MLP in one kernel (kernels.linear.gemv_mlp) inside the model: every layer of an
even count of dense layers takes it, with the greedy tokens of the two-kernel MLP and its
logprobs to float32 rounding; models it cannot hold keep the two kernels (float16; Triton
interpreted on CPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402

from benchmarks.random_checkpoints import build_checkpoint  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.models.decoder_mlp import DecoderMLP, MlpTurns  # noqa: E402
from tests.models.test_fused_decode import DEVICE, MOE, SHAPE, _rebind, spy_gemv  # noqa: E402

pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90")
STEPS = 5  # decode steps of a 6-token completion


def _mlps(llm: LLM) -> list[DecoderMLP]:
    return [layer.mlp for layer in llm.model_runner.model.model.layers]


def _engine(path: str, eager: bool = True) -> LLM:
    return LLM(path, device=DEVICE, attention_backend="triton", dtype="float16",
               enforce_eager=eager, num_kvcache_blocks=8, max_num_seqs=4, max_model_len=512)


@pytest.mark.parametrize("eager", [True] if DEVICE == "cpu" else [True, False])
def test_lone_token_mlp_in_one_kernel(eager: bool, tmp_path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Four dense layers: each decode step runs the MLP kernel in every layer (taking turns on
    the partial rows), and gives the two-kernel MLP's tokens; logprobs within a float16 logit's
    rounding (the partials are added in another order)."""
    monkeypatch.setenv("NANOVLLM_FUSED_LIMITS", "fixed")
    path = build_checkpoint(str(tmp_path), family="Qwen3", **SHAPE, num_hidden_layers=4)
    llm = _engine(path, eager)
    prompt = [[(13 * j) % 300 + 1 for j in range(21)]]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 1, ignore_eos=True, logprobs=3)
    try:
        assert [mlp.turn[1] for mlp in _mlps(llm)] == [0, 1, 0, 1]
        _rebind(llm, True)
        calls = spy_gemv(monkeypatch)
        got = [llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2)]
        on = list(calls)
        for mlp in _mlps(llm):
            mlp.turn = None
        if not eager:  # graphs captured with the kernel: again without it
            llm.model_runner.capture_cudagraph()
        want = llm.generate(prompt, params, use_tqdm=False)[0]
        off = calls[len(on):]
    finally:
        llm.shutdown()
    if eager:  # CUDA graphs replay the kernels without calling them
        def partials(calls: list[str]) -> int:  # o_proj's GEMVs, and down_proj's if its own
            return sum(name.startswith("gemv_partials") for name in calls)
        assert on.count("gate_up_down_gemv") == 2 * STEPS * 4 == partials(on)
        assert on.count("norm_gate_up_silu_gemv") == 0
        assert off.count("gate_up_down_gemv") == 0 and partials(off) == 2 * STEPS * 4
        assert off.count("norm_gate_up_silu_gemv") == STEPS * 4
    # The partials' other summing order can flip a float16 rounding of the residual, and that
    # moves a float16 logit by about one unit in its last place: 0.0156 for |logit| in [16, 32).
    # A logprob is its logit less the log-sum, which the top logit dominates and which may move
    # the other way: up to two units, 0.031.
    for run in got:  # the second run starts from the rows the first one left
        assert run["token_ids"] == want["token_ids"]
        for step, want_step in zip(run["logprobs"], want["logprobs"]):
            assert step.keys() == want_step.keys()
            for token, logprob in step.items():
                assert abs(logprob - want_step[token]) < 3.2e-2, (token, logprob, want_step)


@pytest.mark.parametrize("fields", [dict(num_hidden_layers=3),
                                    dict(MOE, num_hidden_layers=4, mlp_only_layers=[1, 2])])
def test_models_it_cannot_hold_keep_two_kernels(fields: dict, tmp_path) -> None:
    """An odd layer count, or a sparse layer between dense ones: no layer takes turns."""
    family = "Qwen3Moe" if "num_experts" in fields else "Qwen3"
    path = build_checkpoint(str(tmp_path), family=family, **SHAPE, **fields)
    llm = _engine(path)
    try:
        parities = [getattr(mlp, "turn", None) for mlp in _mlps(llm)]
    finally:
        llm.shutdown()
    assert parities == [None] * fields["num_hidden_layers"]


def test_turns_reset_the_rows_when_a_step_breaks_them() -> None:
    """A step whose layers did not all take their turn is a RuntimeError, and one that stops
    between layers re-raises; either way the rows are zeroed again. An odd count: no turns."""
    config = PretrainedConfig(hidden_size=8, intermediate_size=16)
    mlps = [DecoderMLP(config, False, None, f"model.layers.{i}.mlp.") for i in range(2)]
    turns = MlpTurns(mlps)
    assert [mlp.turn for mlp in mlps] == [(turns.rows, 0), (turns.rows, 1)]
    like = torch.zeros(1, 8)
    turns.rows.pair(0, like)
    for took, error in (([True, False], RuntimeError), ([True, True], KeyError)):
        turns.rows.rows.fill_(1.0)
        with pytest.raises(error):
            with turns.step():
                for mlp, turn in zip(mlps, took):
                    mlp.took_turn = turn
                if error is KeyError:
                    raise KeyError("stopped between layers")
        assert torch.count_nonzero(turns.rows.rows) == 0
    with turns.step():  # every layer, or none: the rows stay as the kernels left them
        turns.rows.rows.fill_(1.0)
    assert torch.count_nonzero(turns.rows.rows) == turns.rows.rows.numel()
    odd = [DecoderMLP(config, False, None, f"model.layers.{i}.mlp.") for i in range(3)]
    MlpTurns(odd)
    assert [mlp.turn for mlp in odd] == [None] * 3
