"""The swapped-operand W8A8 GEMM (kernels.linear.w8a8_swap) vs the torch reference: per-channel
and 128x128 block scales, one K split and several (float32 partials summed), on CPU under
TRITON_INTERPRET; layer-sized shapes on CUDA."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.linear import fp8_gemm  # noqa: E402
from nanovllm.kernels.linear.fp8_gemm import DECODE_TOKENS, SWAP_TOKENS  # noqa: E402
from nanovllm.kernels.linear.fp8_quant import per_token_group_quant  # noqa: E402
from nanovllm.kernels.linear.fp8_reference import (  # noqa: E402
    dequantize_groups,
    fp8_linear_torch,
    per_token_group_quant_torch,
    quantize_groups,
)
from nanovllm.kernels.linear.w8a8_swap import fits_w8a8_swap, swap_config, w8a8_swap  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# sm_90's FP8 MMA accumulates a K step's 128 products at reduced precision (about 1e-4 of the
# output on the H200); the interpreter's is float32
TOLERANCE = 1e-3 if DEVICE == "cuda" else 1e-4


def _operands(m: int, n: int, k: int, block: tuple[int, int] | None):
    g = torch.Generator().manual_seed(0)
    # rows and columns of very different magnitude: a scale of the wrong row or token shows
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-4, 5, (m, 1), generator=g)
    w = torch.randn(n, k, generator=g) * 2.0 ** torch.randint(-3, 4, (n, 1), generator=g)
    codes, scale = quantize_groups(w, *(block or (1, k)))
    return x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m,config", [(17, (128, 32, 1, 2, 4)), (40, (128, 64, 2, 2, 4)),
                                      (150, (64, 64, 2, 2, 4))])
def test_w8a8_swap_applies_both_scales(m, config, block):
    """Given the reference's codes and scales, the GEMM (its split sum, several token tiles,
    64-row weight tiles) is the reference's product, bias included."""
    n, k = 256, 512
    x, weight, weight_scale = _operands(m, n, k, block)
    codes, scales = per_token_group_quant_torch(x, (block or (1, k))[1])
    bias = torch.randn(n, device=DEVICE)
    out = w8a8_swap(codes, scales, weight, weight_scale, block, bias, torch.float32,
                    config=config)
    ref = fp8_linear_torch(x, weight, weight_scale, block, bias)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=TOLERANCE * ref.abs().max().item())


def test_swap_config_follows_the_sweep():
    """Llama-3.1-8B's shapes on 132 SMs, as the H200 sweep found best (or within 5%): at 64
    tokens o_proj and down_proj split K; at 128 gate_up takes 128-row tiles, 8 warps and no
    split; 20 tokens take a 32-token tile."""
    assert swap_config(64, 4096, 4096, 132) == (64, 64, 2, 4, 4)
    assert swap_config(64, 4096, 14336, 132) == (64, 64, 4, 4, 4)
    assert swap_config(128, 28672, 4096, 132) == (128, 128, 1, 3, 8)
    assert swap_config(20, 6144, 4096, 132)[1] == 32
    assert fits_w8a8_swap(4096, 4096, (128, 128)) and not fits_w8a8_swap(4096, 4096, (64, 128))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [24, 100, 256, 1000])  # 1000: a prefill chunk (blocks)
def test_layer_sized_w8a8_swap_on_cuda(m, block):
    """An 8B o_proj-sized GEMM with swap_config's own tiles and splits, against the reference."""
    n, k = 4096, 4096
    x, weight, weight_scale = _operands(m, n, k, block)
    x = x.bfloat16()
    codes, scales = per_token_group_quant_torch(x, (block or (1, k))[1])
    out = w8a8_swap(codes, scales, weight, weight_scale, block, None, torch.bfloat16)
    ref = fp8_linear_torch(x, weight, weight_scale, block)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2,
                               atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("m,block,swapped", [(DECODE_TOKENS, None, False),
                                             (DECODE_TOKENS + 1, None, True),
                                             (SWAP_TOKENS + 1, None, False),
                                             (SWAP_TOKENS + 1, (128, 128), True)])
def test_fp8_linear_swaps_operands_above_decode_tokens(m, block, swapped, monkeypatch):
    """fp8_linear takes the swapped GEMM from DECODE_TOKENS + 1 tokens of 16-bit activations
    (per channel up to SWAP_TOKENS), and its result is the product of its own activation codes
    (the interpreter rounds a few codes off the reference's, see test_fp8_gemm) and the
    dequantized weight."""
    calls = []
    monkeypatch.setattr(fp8_gemm, "w8a8_swap",
                        lambda *a, **kw: calls.append(a[0].shape) or w8a8_swap(*a, **kw))
    x, weight, weight_scale = _operands(m, 128, 256, block)
    x = x.half()  # 16-bit, as split-K takes up to DECODE_TOKENS (bf16 garbles on CPU)
    # 2 K blocks and float16: cuBLAS's block-scaled GEMM (test_fp8_gemm) takes neither
    assert not fp8_gemm._runs_block_scaled_mm(x, weight, weight_scale, block)
    out = fp8_gemm.fp8_linear(x, weight, weight_scale, block)
    assert bool(calls) == swapped
    if swapped:
        groups = block or (1, 256)
        codes, scales = per_token_group_quant(x, groups[1])
        ref = (codes.float() * scales.repeat_interleave(groups[1], 1)) \
            @ dequantize_groups(weight, weight_scale, *groups).t()
        torch.testing.assert_close(out.float(), ref, rtol=1e-2,
                                   atol=2e-3 * ref.abs().max().item())


def test_fp8_linear_of_no_tokens_is_empty():
    """An empty batch gives an empty output (no kernel takes zero rows)."""
    x, weight, weight_scale = _operands(1, 128, 256, None)
    out = fp8_gemm.fp8_linear(x[:0].half(), weight, weight_scale, None)
    assert out.shape == (0, 128)
