"""The fused decode projections with FP8 weights (W8A16: kernels.linear.fused_fp8) vs the unfused
math in float32 on the dequantized weight (TRITON_INTERPRET on CPU), per output channel and per
block; scales moved to other channels or blocks must fail the same comparison."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE  # noqa: E402
from nanovllm.kernels.linear.fp8_reference import dequantize_groups, quantize_groups  # noqa: E402
from nanovllm.kernels.linear.fused import fits_qkv, qkv_rope_store  # noqa: E402
from nanovllm.kernels.linear.fused_gate_up import fits_gate_up, gate_up_silu  # noqa: E402
from nanovllm.kernels.linear.split_k import fits_split_k, split_k_linear  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, MAX_POS = 256, 2048
# as tests/kernels/test_fused_linear.py's: the GEMM sums in another order than the reference
TOL = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (1e-2, 1e-2)}
# The interpreter's TMA loads garble bf16 (numpy has none): bf16 runs on CUDA only.
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
BLOCKS = [None, (128, 128)]  # per output channel; Qwen's and DeepSeek's FP8 releases
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90")


def _fp8_weight(rows: int, cols: int, block: tuple[int, int] | None, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, the float32 weight they mean) of a [rows, cols] weight whose 64 x 64
    tiles differ in magnitude by up to 2**4 (iid weights would give every scale about the same
    value, and a scale read from the wrong channel or block would go unnoticed)."""
    g = torch.Generator().manual_seed(seed)
    tiles = 2.0 ** torch.randint(-2, 3, (rows // 64, cols // 64), generator=g).float()
    magnitude = tiles.repeat_interleave(64, 0).repeat_interleave(64, 1)
    weight = torch.randn(rows, cols, generator=g) * cols ** -0.5 * magnitude
    groups = block or (1, cols)
    codes, scales = quantize_groups(weight, *groups)
    dequantized = dequantize_groups(codes, scales, *groups)
    return codes.to(DEVICE), scales.to(DEVICE), dequantized.to(DEVICE)


def _moved(scales: torch.Tensor) -> torch.Tensor:
    """The scales each moved to the next channel or block (a layout bug's scales)."""
    return scales.flatten().roll(1).view_as(scales).contiguous()


def _rows(num_tokens: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Input rows whose scale differs from row to row."""
    scale = torch.rand(num_tokens, 1, device=DEVICE) * 3 + 0.2
    return (torch.randn(num_tokens, cols, device=DEVICE) * scale).to(dtype)


def _assert_close_only_with_the_right_scales(run, want: torch.Tensor, scales: torch.Tensor,
                                             atol: float, rtol: float) -> None:
    torch.testing.assert_close(run(scales), want, atol=atol, rtol=rtol)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run(_moved(scales)), want, atol=atol, rtol=rtol)


def test_fits_fp8_weights() -> None:
    """FP8 codes per channel or in blocks of (a multiple of 64 rows, 128 columns), for 16-bit
    activations; other blocks, and a block on a 16-bit weight, are refused."""
    bf16 = torch.bfloat16
    for block in (None, (128, 128), (64, 128), (256, 128)):
        assert fits_qkv(1024, 128, bf16, FP8_DTYPE, block)
        assert fits_gate_up(1024, 3072, bf16, FP8_DTYPE, block)
        assert fits_split_k(3072, 1024, torch.float16, FP8_DTYPE, block)
    for block in ((128, 64), (32, 128), (128, 256)):
        assert not fits_qkv(1024, 128, bf16, FP8_DTYPE, block)
        assert not fits_gate_up(1024, 3072, bf16, FP8_DTYPE, block)
        assert not fits_split_k(3072, 1024, bf16, FP8_DTYPE, block)
    assert not fits_qkv(1024, 128, torch.float32, FP8_DTYPE)  # activations stay 16-bit
    assert not fits_gate_up(1024, 3072, bf16, bf16, (128, 128))
    assert not fits_split_k(3072, 1024, bf16, torch.float16)  # weight and activations differ


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("num_tokens,bias", [(1, True), (3, False), (37, True)])  # 1: a GEMV
def test_qkv_rope_store_fp8(dtype: torch.dtype, block, num_tokens: int, bias: bool) -> None:
    """q equals the dequantized qkv_proj (float32, rounded as its output) -> q norm -> RoPE; k
    and v land in their cache slots likewise."""
    torch.manual_seed(num_tokens)
    heads, kv_heads, head_dim = 2, 1, 128
    codes, scales, weight = _fp8_weight((heads + 2 * kv_heads) * head_dim, HIDDEN, block, 1)
    b = torch.randn(weight.shape[0], device=DEVICE).to(dtype) if bias else None
    norms = [RMSNorm(head_dim, eps=0.1).to(device=DEVICE, dtype=dtype) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_(1.0, 0.3)
    rope = RotaryEmbedding(head_dim, MAX_POS, {"rope_type": "default", "rope_theta": 1e6})
    rope = rope.to(DEVICE)
    x = _rows(num_tokens, HIDDEN, dtype)
    positions = torch.randint(0, MAX_POS, (num_tokens,), device=DEVICE)
    slots = torch.randperm(256, device=DEVICE)[:num_tokens]
    with torch.no_grad():
        qkv = F.linear(x.float(), weight, None if b is None else b.float()).to(dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k = norms[0].rms_forward(q.reshape(-1, heads, head_dim)), \
            norms[1].rms_forward(k.reshape(-1, kv_heads, head_dim))
        q_ref, k_ref = rope(positions, q, k)
    want = torch.cat([q_ref.flatten(1), k_ref.flatten(1), v], 1)
    atol, rtol = TOL[dtype]

    def run(w_scale: torch.Tensor) -> torch.Tensor:
        """q, then k and v read back from their cache slots: [tokens, (Hq + 2 Hkv) D]."""
        k_cache = torch.zeros(16, 16, kv_heads, head_dim, device=DEVICE, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q_out = qkv_rope_store(x, codes, b, heads, kv_heads, positions, norms[0].weight,
                               norms[1].weight, 0.1, rope.cos_sin_cache, k_cache, v_cache,
                               slots, w_scale=w_scale, w_block=block)
        k_got, v_got = (c.view(256, -1)[slots] for c in (k_cache, v_cache))
        return torch.cat([q_out.flatten(1), k_got, v_got], 1)

    _assert_close_only_with_the_right_scales(run, want, scales, atol, rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("num_tokens,bias", [(5, False), (33, True)])
def test_gate_up_silu_fp8(dtype: torch.dtype, block, num_tokens: int, bias: bool) -> None:
    """Equals the dequantized gate_up_proj (float32, rounded as its output) -> SiLU-and-mul;
    with (128, 128) blocks the gate's last 64 rows share a block row with the up's first."""
    torch.manual_seed(num_tokens)
    inter = 192
    codes, scales, weight = _fp8_weight(2 * inter, HIDDEN, block, 2)
    b = torch.randn(2 * inter, device=DEVICE).to(dtype) if bias else None
    x = _rows(num_tokens, HIDDEN, dtype)
    with torch.no_grad():
        projected = F.linear(x.float(), weight, None if b is None else b.float()).to(dtype)
        want = SiluAndMul.torch_forward(projected)
    atol, rtol = TOL[dtype]
    _assert_close_only_with_the_right_scales(
        lambda s: gate_up_silu(x, codes, b, w_scale=s, w_block=block), want, scales, atol, rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS + [(64, 128)])
@pytest.mark.parametrize("num_tokens,input_size,splits", [(5, 512, 4), (40, 384, 1)])
def test_split_k_linear_fp8(dtype: torch.dtype, block, num_tokens: int, input_size: int,
                            splits: int) -> None:
    """The partials of FP8 codes stored [N, K] (the FP8 layer's layout) sum to the float32
    product with the dequantized weight."""
    torch.manual_seed(num_tokens)
    output = 128
    codes, scales, weight = _fp8_weight(output, input_size, block, 3)
    x = _rows(num_tokens, input_size, dtype)
    parts = split_k_linear(x, codes, w_scale=scales, w_block=block)
    assert parts.dtype == torch.float32 and parts.shape == (splits, num_tokens, output)
    want = F.linear(x.float(), weight)
    _assert_close_only_with_the_right_scales(
        lambda s: split_k_linear(x, codes, w_scale=s, w_block=block).sum(0), want, scales,
        1e-3, 1e-3)
