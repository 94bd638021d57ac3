"""One-token GEMV kernels (kernels.linear.gemv) vs float32 torch (TRITON_INTERPRET on CPU):
16-bit weights in both layouts, FP8 codes per channel, gate_up with SiLU-and-mul, whole rows;
gate_up and whole rows with the add + RMSNorm before them (kernels.linear.norm_prologue)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE  # noqa: E402
from nanovllm.kernels.fused_ops import add_partials_rms_norm  # noqa: E402
from nanovllm.kernels.linear import fused as fused_linear  # noqa: E402
from nanovllm.kernels.linear.fp8_gemm import fp8_linear  # noqa: E402
from nanovllm.kernels.linear.fused_gate_up import gate_up_silu  # noqa: E402
from nanovllm.kernels.linear.gemv import (  # noqa: E402
    _rows_per_program,
    gemv_rows,
    norm_gemv_rows,
    runs_gemv_rows,
    runs_norm_gemv_rows,
)
from nanovllm.kernels.linear.gemv_gate_up import (  # noqa: E402
    gate_up_silu_gemv,
    norm_gate_up_silu_gemv,
    runs_gate_up_gemv,
    runs_norm_gate_up_gemv,
)
from nanovllm.kernels.linear.gemv_partials import (  # noqa: E402
    _partials_tiles,
    gemv_partials,
    runs_gemv,
)
from nanovllm.kernels.linear.norm_prologue import PendingNorm  # noqa: E402
from nanovllm.kernels.linear.split_k import split_k_linear  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from tests.kernels.gemv_cases import DEVICE, DTYPES, gemv_weight, token_row  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["row-major", "fp8"])
@pytest.mark.parametrize("inter,hidden,bias", [(192, 1000, True), (256, 512, False)])
def test_gate_up_silu_gemv(dtype, fmt, inter, hidden, bias) -> None:
    """Equals gate_up_proj -> SiLU-and-mul (K need not be a power of two)."""
    torch.manual_seed(inter)
    weight, scales, w32 = gemv_weight(2 * inter, hidden, fmt, dtype)
    b = torch.randn(2 * inter, device=DEVICE).to(dtype) if bias else None
    x = token_row(hidden, dtype)
    assert runs_gate_up_gemv(x, weight, scales)
    projected = F.linear(x.float(), w32, None if b is None else b.float()).to(dtype)
    want = SiluAndMul.torch_forward(projected)
    got = gate_up_silu_gemv(x, weight, b, scales)
    assert got.shape == (1, inter) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    if scales is not None:
        wrong = gate_up_silu_gemv(x, weight, b, scales.flip(0).contiguous())
        assert not torch.allclose(wrong, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["row-major", "fp8"])
@pytest.mark.parametrize("rows,cols,bias", [(96, 1000, True), (512, 256, False)])
def test_gemv_rows(dtype, fmt, rows, cols, bias) -> None:
    """Equals x @ W.T + b in float32, rounded once (K need not be a power of two)."""
    torch.manual_seed(rows + cols)
    weight, scales, w32 = gemv_weight(rows, cols, fmt, dtype)
    b = torch.randn(rows, device=DEVICE).to(dtype) if bias else None
    x = token_row(cols, dtype)
    assert runs_gemv_rows(x, weight, scales)
    want = F.linear(x.float(), w32, None if b is None else b.float())
    got = gemv_rows(x, weight, b, scales)
    assert got.shape == (1, rows) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    if scales is not None:
        wrong = gemv_rows(x, weight, b, scales.flip(0).contiguous()).float()
        assert not torch.allclose(wrong, want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["row-major", "fp8"])
@pytest.mark.parametrize("inter,hidden,splits", [(192, 1000, 4), (256, 512, 1)])
def test_norm_gate_up_silu_gemv(dtype, fmt, inter, hidden, splits) -> None:
    """Equals add_partials_rms_norm then gate_up_silu_gemv (bit for bit under the interpreter;
    on a GPU the two kernels may sum the squares in other orders), the residual exactly."""
    torch.manual_seed(inter + splits)
    weight, scales, _ = gemv_weight(2 * inter, hidden, fmt, dtype)
    b = torch.randn(2 * inter, device=DEVICE).to(dtype)
    norm_weight = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    norm = PendingNorm(torch.randn(splits, 1, hidden, device=DEVICE) * 3, token_row(hidden, dtype),
                       norm_weight, 1e-5)
    assert runs_norm_gate_up_gemv(norm, weight, scales)
    normed, want_res = add_partials_rms_norm(*norm)
    want = gate_up_silu_gemv(normed, weight, b, scales)
    got, got_res = norm_gate_up_silu_gemv(norm, weight, b, scales)
    assert torch.equal(got_res, want_res)
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    other, _ = norm_gate_up_silu_gemv(norm._replace(weight=norm_weight.flip(0).contiguous()),
                                      weight, b, scales)
    assert not torch.allclose(other, want, atol=3e-2, rtol=3e-2)  # the norm weight is used


def test_norm_in_gate_up_only_where_its_reads_are_cheap() -> None:
    """Every program reads all partials: refused past half the weight's bytes (Llama-3.1-8B
    bf16: 16 partials of its 4,096-wide hidden state, 2 gate rows a program)."""
    weight = torch.zeros(2 * 64, 4096, dtype=torch.bfloat16, device=DEVICE)
    residual = token_row(4096, torch.bfloat16)
    norm_weight = torch.ones(4096, dtype=torch.bfloat16, device=DEVICE)

    def runs(splits: int) -> bool:
        partials = torch.zeros(splits, 1, 4096, device=DEVICE)
        return runs_norm_gate_up_gemv(PendingNorm(partials, residual, norm_weight, 1e-5), weight)
    assert runs(1) and not runs(2) and not runs(16)  # 2 rows x 2 bytes: one 4-byte partial


def _pending(splits: int, hidden: int, dtype: torch.dtype) -> PendingNorm:
    norm_weight = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    return PendingNorm(torch.randn(splits, 1, hidden, device=DEVICE) * 3, token_row(hidden, dtype),
                       norm_weight, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["row-major", "fp8"])
@pytest.mark.parametrize("rows,cols,bias", [(128, 1000, True), (512, 256, False)])
@pytest.mark.parametrize("splits", range(1, 7))
def test_norm_gemv_rows(dtype, fmt, rows, cols, bias, splits) -> None:
    """Equals add_partials_rms_norm then gemv_rows (bit for bit under the interpreter; on a GPU
    the two kernels may sum the squares in other orders), the residual exactly."""
    torch.manual_seed(rows + splits)
    weight, scales, _ = gemv_weight(rows, cols, fmt, dtype)
    b = torch.randn(rows, device=DEVICE).to(dtype) if bias else None
    norm = _pending(splits, cols, dtype)
    # FP8 codes at K 1,000 take 4 partials at most: their programs hold as many rows as 16-bit
    # ones, half the bytes (test_norm_in_whole_rows_only_where_its_reads_are_cheap)
    refused = fmt == "fp8" and cols == 1000 and splits > 4
    assert runs_norm_gemv_rows(norm, weight, scales) != refused
    if refused:
        return
    normed, want_res = add_partials_rms_norm(*norm)
    want = gemv_rows(normed, weight, b, scales)
    got, got_res = norm_gemv_rows(norm, weight, b, scales)
    assert got.shape == (1, rows) and got.dtype == dtype and torch.equal(got_res, want_res)
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    other, _ = norm_gemv_rows(norm._replace(weight=norm.weight.flip(0).contiguous()), weight,
                              b, scales)
    assert not torch.allclose(other, want, atol=2e-2, rtol=1e-2)  # the norm weight is used


def test_norm_in_whole_rows_only_where_its_reads_are_cheap() -> None:
    """Qwen3-0.6B's qkv_proj takes down_proj's 6 partials (128 programs of 32 rows read 3 of
    its 8 MB), at most 8; FP8 per channel, the same rows (elements, not bytes: NORM_ROWS_ELEMENTS)
    and down_proj's 3 partials (1.5 of 4 MB), at most 4. Llama-3.1-8B bf16's (28 of 4,096) are
    refused: 768 programs would read seven times its weight. Only 16-bit tokens of one row and
    float32 partials are taken."""
    weight = torch.zeros(4096, 1024, dtype=torch.bfloat16, device=DEVICE)
    assert runs_norm_gemv_rows(_pending(6, 1024, torch.bfloat16), weight)
    assert runs_norm_gemv_rows(_pending(8, 1024, torch.bfloat16), weight)
    assert not runs_norm_gemv_rows(_pending(9, 1024, torch.bfloat16), weight)
    codes, scales = weight.to(FP8_DTYPE), torch.ones(4096, 1, device=DEVICE)
    assert _partials_tiles(1024, 3072, 1, False) == (16, 1024)  # FP8 down_proj: 3 partials
    # Qwen3-0.6B's o_proj: 16 columns of 512 K rows, 32 where the program merges 4 heads
    assert _partials_tiles(1024, 2048, 2, True) == (16, 512)
    assert _partials_tiles(1024, 2048, 2, True, merge=True) == (32, 512)
    # 48 columns: unmerged programs of 16 fit, merging ones of 32 do not (the merge launches)
    assert _partials_tiles(48, 512, 2, True) == (16, 512)
    assert _partials_tiles(48, 512, 2, True, merge=True) is None
    assert _rows_per_program(codes, _pending(3, 1024, torch.bfloat16)) == 32
    assert runs_norm_gemv_rows(_pending(3, 1024, torch.bfloat16), codes, scales)
    assert runs_norm_gemv_rows(_pending(4, 1024, torch.bfloat16), codes, scales)
    assert not runs_norm_gemv_rows(_pending(5, 1024, torch.bfloat16), codes, scales)
    llama = torch.zeros(6144, 4096, dtype=torch.bfloat16, device=DEVICE)
    assert not runs_norm_gemv_rows(_pending(28, 4096, torch.bfloat16), llama)
    norm = _pending(6, 1024, torch.bfloat16)
    assert not runs_norm_gemv_rows(_pending(6, 1024, torch.float32), weight.float())
    assert not runs_norm_gemv_rows(norm._replace(partials=norm.partials.half()), weight)
    assert not runs_norm_gemv_rows(norm._replace(weight=norm.weight.float()), weight)
    two = norm._replace(partials=norm.partials.expand(6, 2, 1024).contiguous(),
                        residual=norm.residual.expand(2, 1024).contiguous())
    assert not runs_norm_gemv_rows(two, weight)


def test_takes_one_token_of_supported_formats() -> None:
    """Two tokens, block scales, float32 activations or an odd row count go elsewhere."""
    weight, scales, _ = gemv_weight(128, 512, "fp8", torch.bfloat16)
    x = token_row(512, torch.bfloat16)
    assert runs_gemv(x, weight, scales) and runs_gate_up_gemv(x, weight, scales)
    assert not runs_gemv(torch.cat([x, x]), weight, scales)
    assert not runs_gemv(x, weight, scales, (128, 128))
    assert not runs_gemv(x.float(), weight.float())
    assert not runs_gemv(x[:, :256], weight, scales)  # x narrower than the weight's K
    assert not runs_gemv(x, weight, scales[:1])  # a per-tensor scale: layers expand it to [N, 1]
    assert not runs_gate_up_gemv(torch.cat([x, x]), weight, scales)
    assert runs_gemv_rows(x, weight, scales) and not runs_gemv_rows(torch.cat([x, x]), weight)
    assert not runs_gemv_rows(x, weight, scales, (128, 128))
    assert not runs_gemv_rows(x, weight.t().contiguous().t(), scales)  # rows must be contiguous
    w16 = weight.float().to(torch.bfloat16)
    assert runs_gemv(x, w16) and not runs_gemv(x, w16[:100])  # rows the tiles do not divide
    wide = torch.zeros(2, 16384, dtype=torch.bfloat16, device=DEVICE)  # 32 KB a row
    row = token_row(16384, torch.bfloat16)
    assert not runs_gate_up_gemv(row, wide)  # one pair over PAIR_BYTES
    assert not runs_gemv_rows(row, wide)  # one row over WHOLE_ROWS_BYTES
    # more partials than the norm after sums: a 16-bit k-major K of 64 K slices and more
    long = torch.zeros(32 * 256 * 65, 32, dtype=torch.bfloat16, device=DEVICE).t()
    assert not runs_gemv(token_row(32 * 256 * 65, torch.bfloat16), long)


def test_split_k_and_gate_up_take_it_at_one_token() -> None:
    """split_k_linear and gate_up_silu hand one token to the GEMV: its split count, its
    values."""
    weight, _, _ = gemv_weight(128, 3072, "k-major", torch.float16)
    x = token_row(3072, torch.float16)
    parts = split_k_linear(x, weight)
    assert torch.equal(parts, gemv_partials(x, weight))
    weight, _, _ = gemv_weight(256, 512, "row-major", torch.float16)
    x = token_row(512, torch.float16)
    assert torch.equal(gate_up_silu(x, weight, None), gate_up_silu_gemv(x, weight, None))


def test_qkv_and_fp8_linear_take_whole_rows_at_one_token(monkeypatch) -> None:
    """qkv_rope_store and fp8_linear hand one token to gemv_rows (no partials to sum)."""
    calls = []
    real = fused_linear.gemv_rows
    monkeypatch.setattr(fused_linear, "gemv_rows", lambda *a: calls.append("qkv") or real(*a))
    heads, kv_heads, head_dim = 2, 1, 128
    weight, _, _ = gemv_weight((heads + 2 * kv_heads) * head_dim, 256, "row-major", torch.float16)
    x = token_row(256, torch.float16)
    cache = torch.zeros(4, 16, kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    cos_sin = torch.randn(64, head_dim, device=DEVICE)
    pos, slots = (torch.tensor([5], device=DEVICE) for _ in range(2))
    fused_linear.qkv_rope_store(x, weight, None, heads, kv_heads, pos, None, None, 0.0,
                                cos_sin, cache, cache.clone(), slots)
    assert calls == ["qkv"]
    codes, scales, w32 = gemv_weight(256, 512, "fp8", torch.float16)
    x = token_row(512, torch.float16)
    got = fp8_linear(x, codes, scales, None)
    assert torch.equal(got, gemv_rows(x, codes, None, scales))
