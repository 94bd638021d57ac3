"""The W8A8 FP8 Triton kernels vs their torch reference (kernels.linear.fp8_reference): the
activation quantization, the block-scaled GEMM and fp8_linear's dispatch. On CPU under
TRITON_INTERPRET with tiny shapes; on CUDA the same tests, plus layer-sized shapes (marked gpu)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.linear.fp8_gemm import DECODE_TOKENS, fp8_linear, w8a8_gemm  # noqa: E402
from nanovllm.kernels.linear.fp8_quant import per_token_group_quant  # noqa: E402
from nanovllm.kernels.linear.fp8_reference import (  # noqa: E402
    FP8_DTYPE,
    dequantize_groups,
    fp8_linear_torch,
    per_token_group_quant_torch,
    quantize_groups,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter rounds to e4m3 wrongly where rounding up carries into the exponent (x.97 ->
# a power of two comes out as half of it); the GPU rounds as torch does.
MIN_EXACT_CODES = 0.999 if DEVICE == "cuda" else 0.95


def _activations(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # rows and groups of very different magnitude: a scale taken from the wrong group shows
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-4, 5, (m, 1), generator=g)
    return x.to(DEVICE, dtype)


def _weight(n: int, k: int, block: tuple[int, int] | None, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-3, 4, (n, 1), generator=g)
    codes, scale = quantize_groups(w, *(block or (1, k)))
    return codes.to(DEVICE), scale.to(DEVICE)


# many groups a program (2,048 / 128), a partial last group, a per-token row, one past the
# row kernel's limit (the two-pass kernel)
@pytest.mark.parametrize("m,k,group", [(3, 64, 16), (5, 80, 32), (2, 48, 48), (1, 1100, 1100),
                                       (7, 2048, 128), (5, 300, 128), (9, 1000, 100),
                                       (2, 20000, 20000)])
def test_per_token_group_quant_matches_the_reference(m, k, group):
    x = _activations(m, k)
    codes, scales = per_token_group_quant(x, group)
    ref_codes, ref_scales = per_token_group_quant_torch(x, group)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    assert codes.dtype == FP8_DTYPE
    exact = (codes.float() == ref_codes.float()).float().mean().item()
    assert exact >= MIN_EXACT_CODES, exact


@pytest.mark.parametrize("k,group", [(512, 128), (20000, 20000)])  # one- and two-pass kernels
def test_outer_major_padded_scales_are_the_same_scales(k, group):
    """cuBLAS's layout: rows padded to a multiple of 4 (zero codes) and the same scales with a
    token's neighbours adjacent (stride (1, padded rows))."""
    x = _activations(6, k)
    codes, scales = per_token_group_quant(x, group, outer_major=True, rows_multiple=4)
    ref_codes, ref_scales = per_token_group_quant_torch(x, group)
    assert codes.shape == (8, k) and scales.shape == (8, k // group)
    assert scales.stride() == (1, 8)
    torch.testing.assert_close(scales[:6], ref_scales, rtol=1e-6, atol=0)
    assert not codes[6:].float().any()
    exact = (codes[:6].float() == ref_codes.float()).float().mean().item()
    assert exact >= MIN_EXACT_CODES, exact


def test_block_scaled_mm_hands_cublas_its_layouts(monkeypatch):
    """Where cuBLAS's block-scaled GEMM runs (on CPU: a stand-in for torch._scaled_mm that
    checks the layouts cuBLAS takes and multiplies the dequantized operands), fp8_linear pads
    the rows to 4, passes outer-major activation scales and the weight's scales transposed,
    cuts the padding off and adds the bias: the reference product."""
    from nanovllm.kernels.linear import fp8_gemm

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        m_pad, k = a.shape
        assert m_pad % 4 == 0 and scale_a.shape == (m_pad, k // 128)
        assert scale_a.stride() == (1, m_pad) and b.stride() == (1, k)
        assert scale_b.shape == (k // 128, b.shape[1] // 128) and scale_b.stride()[0] == 1
        x = dequantize_groups(a, scale_a, 1, 128)
        w = dequantize_groups(b.t(), scale_b.t(), 128, 128)
        return (x @ w.t()).to(out_dtype)

    monkeypatch.setattr(fp8_gemm, "_has_block_scaled_mm", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    x = _activations(fp8_gemm.SWAP_TOKENS + 1, 512, torch.bfloat16)
    weight, weight_scale = _weight(256, 512, (128, 128))
    bias = torch.randn(256, device=DEVICE, dtype=torch.bfloat16)
    assert fp8_gemm._runs_block_scaled_mm(x, weight, weight_scale, (128, 128))
    out = fp8_linear(x, weight, weight_scale, (128, 128), bias).float()
    # the product of the kernel's own codes (the interpreter rounds a few off the reference's)
    codes, scales = per_token_group_quant(x, 128)
    ref = dequantize_groups(codes, scales, 1, 128) \
        @ dequantize_groups(weight, weight_scale, 128, 128).t() + bias.float()
    assert out.shape == (fp8_gemm.SWAP_TOKENS + 1, 256)
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.01 * ref.abs().max().item())


def test_per_channel_weights_hand_cublas_rowwise_scales(monkeypatch):
    """Above SWAP_TOKENS per-channel layers run torch._scaled_mm (on CPU: a stand-in that
    checks what it is handed): per-token scales [M, 1], the weight's [1, N], its codes
    transposed, the bias, fast accumulation (vLLM's sm_90 FP8 GEMMs; +4% on the 8B shape's
    standard workload, docs/quantization.md): the reference product."""
    from nanovllm.kernels.linear import fp8_gemm
    handed = {}

    def scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
        (m, k), n = a.shape, b.shape[1]
        assert scale_a.shape == (m, 1) and scale_b.shape == (1, n) and b.stride() == (1, k)
        handed.update(fast=use_fast_accum, bias=bias)
        y = dequantize_groups(a, scale_a, 1, k) @ dequantize_groups(b.t(), scale_b.t(), 1, k).t()
        return (y + bias.float()).to(out_dtype)

    monkeypatch.setattr(fp8_gemm, "_scaled_mm_fits", lambda x, weight, out_dtype: True)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    x = _activations(fp8_gemm.SWAP_TOKENS + 1, 256, torch.bfloat16)
    weight, weight_scale = _weight(192, 256, None)
    bias = torch.randn(192, device=DEVICE, dtype=torch.bfloat16)
    out = fp8_linear(x, weight, weight_scale, None, bias).float()
    assert handed["fast"] is True and handed["bias"] is bias
    codes, scales = per_token_group_quant(x, 256)  # the interpreter rounds a few codes apart
    ref = dequantize_groups(codes, scales, 1, 256) \
        @ dequantize_groups(weight, weight_scale, 1, 256).t() + bias.float()
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.01 * ref.abs().max().item())


@pytest.mark.parametrize("m,n,k,block", [(1, 48, 64, (32, 32)), (17, 40, 80, (16, 32)),
                                         (5, 32, 96, None)])
def test_w8a8_gemm_applies_both_scales_per_group(m, n, k, block):
    """Given the reference's codes and scales, the GEMM is the reference's product."""
    x = _activations(m, k)
    weight, weight_scale = _weight(n, k, block)
    groups = block or (1, k)
    codes, scales = per_token_group_quant_torch(x, groups[1])
    bias = torch.randn(n, device=DEVICE)
    out = w8a8_gemm(codes, scales, weight, weight_scale, groups, bias, torch.float32)
    ref = fp8_linear_torch(x, weight, weight_scale, block, bias)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("block", [(32, 32), None])
def test_fp8_linear_matches_the_reference(block):
    x = _activations(9, 64)
    weight, weight_scale = _weight(32, 64, block)
    out = fp8_linear(x, weight, weight_scale, block)
    ref = fp8_linear_torch(x, weight, weight_scale, block)
    # a few codes may round differently (see MIN_EXACT_CODES): a few ulps of e4m3 in the sum
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.02 * ref.abs().max().item())


def _w8a16(x, weight, weight_scale, block, bias=None):
    """The decode sizes' reference: unquantized activations times the dequantized weight."""
    w = dequantize_groups(weight, weight_scale, *(block or (1, weight.shape[1])))
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


# The interpreter's TMA loads garble bf16 (numpy has none): float16 on CPU
@pytest.mark.parametrize("m", [1, DECODE_TOKENS, pytest.param(DECODE_TOKENS + 1, marks=[
    pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter's W8A8 codes "
                                        "round off (MIN_EXACT_CODES): W8A8 is tested above")])])
@pytest.mark.parametrize("block", [(128, 128), None])
def test_decode_sizes_run_w8a16_split_k(m, block):
    """Up to DECODE_TOKENS tokens the activations stay unquantized (split-K W8A16): the result
    is the W8A16 product, further from W8A8's than the GEMM's own rounding; above, W8A8."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = _activations(m, 256, dtype)
    weight, weight_scale = _weight(128, 256, block)
    bias = torch.randn(128, device=DEVICE, dtype=dtype)
    out = fp8_linear(x, weight, weight_scale, block, bias).float()
    w8a16 = _w8a16(x, weight, weight_scale, block, bias)
    w8a8 = fp8_linear_torch(x.float(), weight, weight_scale, block, bias.float())
    near, far = (w8a16, w8a8) if m <= DECODE_TOKENS else (w8a8, w8a16)
    assert out.dtype == torch.float32 and out.shape == (m, 128)
    err_near, err_far = ((out - ref).abs().max().item() for ref in (near, far))
    assert err_near < 0.02 * near.abs().max().item() and err_near < err_far / 4, (err_near,
                                                                                  err_far)


def test_a_transposed_block_scale_is_caught():
    """The comparison above can fail: the same codes with the weight's scale grid transposed."""
    x = _activations(4, 64)
    weight, weight_scale = _weight(64, 64, (32, 32))
    out = fp8_linear(x, weight, weight_scale.t().contiguous(), (32, 32))
    ref = fp8_linear_torch(x, weight, weight_scale, (32, 32))
    assert not torch.allclose(out, ref, rtol=0.05, atol=0.02 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 300, 1001])
@pytest.mark.parametrize("block", [(128, 128), None])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_layer_sized_fp8_linear_on_cuda(m, block, n, k):
    """Llama-3.1-8B's qkv_proj and down_proj shapes in bf16: split-K W8A16 up to
    DECODE_TOKENS, then the swapped GEMM, and torch._scaled_mm (rowwise, or block-scaled on
    sm_90; 1,001 rows are padded to 1,004 for it), against the torch references on the GPU."""
    x = _activations(m, k, torch.bfloat16)
    weight, weight_scale = _weight(n, k, block)
    bias = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    out = fp8_linear(x, weight, weight_scale, block, bias).float()
    if m <= DECODE_TOKENS:  # W8A16 split over K
        ref = _w8a16(x, weight, weight_scale, block, bias)
    else:
        ref = fp8_linear_torch(x, weight, weight_scale, block, bias).float()
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.01 * ref.abs().max().item())


@pytest.mark.gpu
def test_block_scaled_weights_take_cublas_above_swap_tokens(monkeypatch):
    """On sm_90 with CUDA 12.9+, block-scaled layers above SWAP_TOKENS run cuBLAS's block-scaled
    GEMM where their K blocks are a multiple of 4, else the swapped Triton one."""
    from nanovllm.kernels.linear import fp8_gemm
    if not fp8_gemm._has_block_scaled_mm(torch.device(DEVICE)):
        pytest.skip("cuBLAS block scales need sm_90 and CUDA 12.9+")
    calls, blocked = [], []
    swap, cublas = fp8_gemm.w8a8_swap, fp8_gemm.block_scaled_mm
    monkeypatch.setattr(fp8_gemm, "w8a8_swap", lambda *a, **kw: calls.append(a) or swap(*a, **kw))
    monkeypatch.setattr(fp8_gemm, "block_scaled_mm",
                        lambda *a, **kw: blocked.append(a) or cublas(*a, **kw))
    for n, k in ((256, 512), (384, 1024), (256, 640)):  # 5 K blocks: the swapped GEMM's
        x = _activations(fp8_gemm.SWAP_TOKENS + 1, k, torch.bfloat16)
        weight, weight_scale = _weight(n, k, (128, 128))
        bias = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
        out = fp8_linear(x, weight, weight_scale, (128, 128), bias).float()
        ref = fp8_linear_torch(x, weight, weight_scale, (128, 128), bias).float()
        torch.testing.assert_close(out, ref, rtol=0.02, atol=0.01 * ref.abs().max().item())
    assert len(calls) == 1 and calls[0][2].shape == (256, 640)
    assert [a[1].shape for a in blocked] == [(256, 512), (384, 1024)]
