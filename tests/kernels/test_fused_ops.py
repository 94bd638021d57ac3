"""RMSNorm, add + RMSNorm, SiLU-and-mul (Triton) vs the layers' torch paths (TRITON_INTERPRET
on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.fused_ops import (  # noqa: E402
    _norm_warps,
    add_partials_rms_norm,
    add_rms_norm,
    rms_norm,
    silu_and_mul,
    silu_and_mul_codes,
)
from nanovllm.kernels.linear.fp8_quant import per_token_group_quant  # noqa: E402
from nanovllm.kernels.linear.token_codes import TokenCodes  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# (atol, rtol). The Triton 3.8 interpreter truncates float32 -> bf16 (hardware rounds to
# nearest even), and the kernels round up to twice, so on CPU bf16 is off by an ulp or two.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _input(rows: int, cols: int, dtype: torch.dtype, extra: int = 0) -> torch.Tensor:
    """[rows, cols] with a per-column scale and shift; `extra` > 0 makes it a strided view."""
    x = torch.randn(rows, cols + extra, device=DEVICE) * 3
    x = (x + torch.randn(cols + extra, device=DEVICE)).to(dtype)
    return x[:, extra:]  # row stride cols + extra when extra > 0


def _norm(hidden: int, dtype: torch.dtype, eps: float = EPS) -> RMSNorm:
    """An RMSNorm with a random weight in the activation dtype (as the model builds it)."""
    norm = RMSNorm(hidden, eps=eps).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    return norm


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape and got.is_contiguous()
    atol, rtol = TOL[ref.dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 1024])  # 96: not a power of two (masked block)
@pytest.mark.parametrize("num_tokens", [1, 7])
@torch.no_grad()
def test_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype) -> None:
    """rms_norm and add_rms_norm, on strided rows, equal RMSNorm's torch methods."""
    torch.manual_seed(hidden + num_tokens)
    norm = _norm(hidden, dtype)
    x, residual = _input(num_tokens, hidden, dtype, extra=8), _input(num_tokens, hidden, dtype)
    x_before, res_before = x.clone(), residual.clone()
    _close(rms_norm(x, norm.weight, EPS), norm.rms_forward(x))
    normed, new_residual = add_rms_norm(x, residual, norm.weight, EPS)
    normed_ref, residual_ref = norm.add_rms_forward(x, residual)
    _close(normed, normed_ref)
    _close(new_residual, residual_ref)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # inputs untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits,hidden", [(1, 96), (4, 96), (16, 1024)])  # 4 and 16 warps
@torch.no_grad()
def test_add_rms_norm_partials(splits: int, hidden: int, dtype: torch.dtype) -> None:
    """add_partials_rms_norm sums float32 split-K partials [S, N, H] as the torch path does (the
    sum rounded to the activation dtype, as the GEMM's output, then added to the residual)."""
    torch.manual_seed(splits)
    norm = _norm(hidden, dtype)
    parts = torch.randn(splits, 5, hidden, device=DEVICE)
    residual = _input(5, hidden, dtype)
    normed, new_residual = add_partials_rms_norm(parts, residual, norm.weight, EPS)
    summed = parts.sum(0).to(dtype)
    normed_ref, residual_ref = norm.add_rms_forward(summed, residual)
    # the interpreter truncates the rounded sum: one ulp of the largest sum more there
    atol = 3e-2 + (torch.finfo(dtype).eps * summed.abs().max().item() if DEVICE == "cpu" else 0)
    torch.testing.assert_close(normed, normed_ref, atol=atol, rtol=3e-2)
    torch.testing.assert_close(new_residual, residual_ref, atol=atol, rtol=3e-2)
    # RMSNorm.add_partials, torch path (the CPU model's reference) and kernel alike
    for fused in (False, True):
        norm.fused = fused
        for got, want in zip(norm.add_partials(parts, residual), (normed_ref, residual_ref)):
            assert got.dtype == dtype and got.shape == residual.shape
            torch.testing.assert_close(got, want, atol=atol, rtol=3e-2)


def test_norm_warps() -> None:
    """Partials: two values a thread, 4 to 32 warps; plain rows and LoRA launches: 4, 8 from
    4,096."""
    assert [_norm_warps(b, 8) for b in (64, 256, 1024, 2048, 4096, 8192)] == [4, 4, 16, 32, 32, 32]
    assert [_norm_warps(b, 0) for b in (64, 1024, 4096, 8192)] == [4, 4, 8, 8]
    assert [_norm_warps(b, 8, lora=True) for b in (1024, 4096)] == [4, 8]


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_rms_norm_heads(dtype: torch.dtype) -> None:
    """[N, heads, D] views of a wider row (as q_norm once took): normalised per head."""
    torch.manual_seed(0)
    norm = _norm(32, dtype)
    q = _input(5, 4 * 32, dtype, extra=64).view(5, 4, 32)  # not flattenable: reshape copies
    _close(rms_norm(q, norm.weight, EPS), norm.rms_forward(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 3072])  # 3072: Qwen3-0.6B's intermediate_size, 3 tiles
@pytest.mark.parametrize("num_tokens", [1, 7])
@torch.no_grad()
def test_silu_and_mul(num_tokens: int, d: int, dtype: torch.dtype) -> None:
    """silu_and_mul on strided rows equals SiluAndMul's torch path."""
    torch.manual_seed(d + num_tokens)
    x = _input(num_tokens, 2 * d, dtype, extra=16)
    _close(silu_and_mul(x), SiluAndMul.torch_forward(x))


def test_empty_batch() -> None:
    """Zero tokens: empty outputs, no launch."""
    x, weight = torch.empty(0, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    assert rms_norm(x, weight, EPS).shape == (0, 64)
    assert [t.shape for t in add_rms_norm(x, x, weight, EPS)] == [(0, 64), (0, 64)]
    assert silu_and_mul(x).shape == (0, 32)


@torch.no_grad()
def test_module_paths() -> None:
    """The modules' forward with `fused` set (as bind_backend sets it) calls the kernels, with
    the module's own weight and eps (large enough that a dropped or wrong eps shows)."""
    torch.manual_seed(0)
    norm = _norm(96, torch.float32, eps=0.5)
    norm.fused = True
    x, residual = _input(3, 96, torch.float32), _input(3, 96, torch.float32)
    _close(norm(x), rms_norm(x, norm.weight, norm.eps))
    for got, ref in zip(norm(x, residual), add_rms_norm(x, residual, norm.weight, norm.eps)):
        _close(got, ref)
    act = SiluAndMul()
    act.fused = True
    _close(act(x), silu_and_mul(x))


def _same_codes(handed: TokenCodes, out: torch.Tensor) -> None:
    """handed holds exactly the codes and scales the FP8 GEMM's own quantization launch gives
    for the 16-bit output (one group a row): a projection fed either computes the same."""
    codes, scales = per_token_group_quant(out.reshape(-1, out.shape[-1]), out.shape[-1])
    assert isinstance(handed, TokenCodes) and handed.scales.shape == (codes.shape[0], 1)
    assert torch.equal(handed.scales, scales)
    assert torch.equal(handed.codes.view(torch.uint8), codes.view(torch.uint8))


@pytest.mark.parametrize("hidden", [96, 1024])
@torch.no_grad()
def test_norms_hand_the_codes_the_gemm_would_make(hidden: int) -> None:
    """rms_norm, add_rms_norm and add_partials_rms_norm with codes: the normed rows as the
    projection's quantization would code them, and the same residual sum."""
    torch.manual_seed(0)
    norm = _norm(hidden, torch.bfloat16)
    x, residual = _input(19, hidden, torch.bfloat16), _input(19, hidden, torch.bfloat16)
    _same_codes(rms_norm(x, norm.weight, EPS, codes=True), rms_norm(x, norm.weight, EPS))
    handed, summed = add_rms_norm(x, residual, norm.weight, EPS, codes=True)
    out, ref_sum = add_rms_norm(x, residual, norm.weight, EPS)
    _same_codes(handed, out)
    assert torch.equal(summed, ref_sum)
    partials = torch.randn(3, 19, hidden, device=DEVICE)
    handed, summed = add_partials_rms_norm(partials, residual, norm.weight, EPS, codes=True)
    out, ref_sum = add_partials_rms_norm(partials, residual, norm.weight, EPS)
    _same_codes(handed, out)
    assert torch.equal(summed, ref_sum)


@pytest.mark.parametrize("d", [48, 3000])  # 3000: a masked row in one program
@torch.no_grad()
def test_silu_and_mul_hands_the_codes_the_gemm_would_make(d: int) -> None:
    """silu_and_mul_codes: one pass a row, the codes of silu_and_mul's output (a strided
    input too); a row of zeros gets the smallest scale, not a division by zero."""
    torch.manual_seed(0)
    x = _input(21, 2 * d, torch.bfloat16, extra=8)
    x[3] = 0
    handed = silu_and_mul_codes(x)
    _same_codes(handed, silu_and_mul(x))
    assert handed.scales[3].item() > 0 and not handed.codes[3].float().any()
