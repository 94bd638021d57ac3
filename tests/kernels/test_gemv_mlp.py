"""A lone token's MLP in one kernel (kernels.linear.gemv_mlp) vs the GEMV it replaces and float32
torch (TRITON_INTERPRET on CPU): down_proj's partial rows, layers taking turns on them, and the
steps it refuses."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.linear.gemv_gate_up import norm_gate_up_silu_gemv  # noqa: E402
from nanovllm.kernels.linear.gemv_mlp import (  # noqa: E402
    gate_up_down_gemv,
    runs_gate_up_down_gemv,
)
from nanovllm.kernels.linear.mlp_partials import SPLITS, MlpPartials  # noqa: E402
from nanovllm.kernels.linear.norm_prologue import PendingNorm  # noqa: E402
from tests.kernels.gemv_cases import DEVICE, DTYPES, gemv_weight, token_row  # noqa: E402

INTER, HIDDEN = 192, 512  # 16 gate rows a program: 12 programs


def _layer(dtype: torch.dtype, seed: int):
    """(gate_up weight, its bias, k-major down weight, its float32 values) of one layer."""
    torch.manual_seed(seed)
    gate_up, _, _ = gemv_weight(2 * INTER, HIDDEN, "row-major", dtype)
    bias = torch.randn(2 * INTER, device=DEVICE).to(dtype)
    down, _, down_f32 = gemv_weight(HIDDEN, INTER, "k-major", dtype)
    return gate_up, bias, down, down_f32


def _norm(dtype: torch.dtype, splits: int, seed: int) -> PendingNorm:
    torch.manual_seed(seed)
    norm_weight = (torch.rand(HIDDEN, device=DEVICE) + 0.5).to(dtype)
    return PendingNorm(torch.randn(splits, 1, HIDDEN, device=DEVICE) * 3,
                       token_row(HIDDEN, dtype), norm_weight, 1e-5)


def _want(norm: PendingNorm, gate_up, bias, down_f32) -> tuple[torch.Tensor, torch.Tensor]:
    """(down_proj's output in float32 from the GEMV's SiLU output, the residual sum)."""
    h, res = norm_gate_up_silu_gemv(norm, gate_up, bias)
    return h.float() @ down_f32.t(), res


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_partials_sum_to_down_proj_of_the_gemv(dtype, splits) -> None:
    """The partial rows sum to down_proj of gate_up_silu's output (the same SiLU values: the
    one-token GEMV's), the residual sum is exact, and the other pair of rows is cleared."""
    gate_up, bias, down, down_f32 = _layer(dtype, 0)
    norm = _norm(dtype, splits, 1)
    assert runs_gate_up_down_gemv(norm, gate_up, down)
    partials = MlpPartials()
    partials.pair(0, norm.residual)
    rows = partials.rows
    rows[1].fill_(7.0)  # as the layer before left it: this kernel clears it
    part, res = gate_up_down_gemv(norm, gate_up, bias, down, partials, 0)
    want, want_res = _want(norm, gate_up, bias, down_f32)
    assert part.shape == (SPLITS, 1, HIDDEN) and part.data_ptr() == rows[0].data_ptr()
    assert torch.equal(res, want_res)
    assert torch.count_nonzero(rows[1]) == 0
    torch.testing.assert_close(part.sum(0), want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(part.sum(0), _want(norm, gate_up, None, down_f32)[0], atol=1e-2)


def test_layers_take_turns_over_steps() -> None:
    """Four layers over two steps, each fed a copy of what the layer before added (its
    qkv_proj reads that, and o_proj's partials feed its MLP): every layer's rows start at
    zero, so each equals its reference."""
    dtype = torch.bfloat16
    layers = [_layer(dtype, seed) for seed in range(4)]
    partials = MlpPartials()
    for step in range(2):
        norm = _norm(dtype, 4, 10 + step)
        for i, (gate_up, bias, down, down_f32) in enumerate(layers):
            part, res = gate_up_down_gemv(norm, gate_up, bias, down, partials, i % 2)
            want, want_res = _want(norm, gate_up, bias, down_f32)
            torch.testing.assert_close(part.sum(0), want, atol=1e-4, rtol=1e-4)
            assert torch.equal(res, want_res)
            norm = norm._replace(partials=part.clone(), residual=res)  # the next layer's
        assert torch.count_nonzero(partials.rows[0]) == 0  # the first layer's turn: clear


def test_refuses_what_it_cannot_hold() -> None:
    """FP8 or row-major down weights, a weight of another dtype, more than one token, and
    partials whose reads are not cheap_enough go to the two-kernel path."""
    dtype = torch.bfloat16
    gate_up, _, down, _ = _layer(dtype, 0)
    norm = _norm(dtype, 4, 1)
    assert runs_gate_up_down_gemv(norm, gate_up, down)
    row_major, _, _ = gemv_weight(HIDDEN, INTER, "row-major", dtype)
    assert not runs_gate_up_down_gemv(norm, gate_up, row_major)
    assert not runs_gate_up_down_gemv(norm, gate_up, down.half())
    assert not runs_gate_up_down_gemv(norm, gate_up.half(), down)
    two = norm._replace(residual=token_row(HIDDEN, dtype).repeat(2, 1),
                        partials=torch.zeros(4, 2, HIDDEN, device=DEVICE))
    assert not runs_gate_up_down_gemv(two, gate_up, down)
    many = norm._replace(partials=torch.zeros(64, 1, HIDDEN, device=DEVICE))
    assert not runs_gate_up_down_gemv(many, gate_up, down)  # 12 programs x 64 rows > half
