"""W8A8 FP8 linear layers on the GPU: activations quantized per token group
(kernels.linear.fp8_quant), then a GEMM of FP8 codes that applies both scales in its epilogue
(kernels.linear.fp8_reference is the reference and describes the layout).

- Block-scaled weights (Qwen's FP8 releases, [128, 128] blocks) above SWAP_TOKENS on sm_90:
  cuBLAS's block-scaled GEMM (torch._scaled_mm, CUDA 12.9+), 2.1-3.3x faster than the swapped
  GEMM at prefill sizes. Those neither takes: our Triton GEMM, one K step per block, each
  step's partial product times its token-group and weight-block scales.
- Per-channel weights: torch._scaled_mm (cuBLAS, rowwise scales, fast accumulation) where it
  takes the shapes and dtype, else the same Triton GEMM with one group spanning all of K.
- With TMA (sm_90), where split-K below does not run: the operands swapped, the weight's rows
  on the MMA's M side (kernels.linear.w8a8_swap), K split for short N, up to SWAP_TOKENS (for
  block scales at any size where cuBLAS lacks them). cuBLAS gave Llama-3.1-8B's o_proj 64
  programs, 13 us against its 4 us of bytes at any batch up to 256.
- Up to DECODE_TOKENS tokens of 16-bit activations: W8A16 split over K instead
  (kernels.linear.split_k, as the fused decode projections run FP8 weights), its partials
  summed. The GEMMs above quantize the activations in a launch of their own, and cuBLAS's
  took 18 us of a 6 us byte floor for Llama-3.1-8B's qkv_proj at 1 token.
"""
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels.linear.fp8_quant import per_token_group_quant
from nanovllm.kernels.linear.gemv import gemv_rows, runs_gemv_rows
from nanovllm.kernels.linear.split_k import fits_split_k, split_k_linear, sum_partials
from nanovllm.kernels.linear.token_codes import TokenCodes
from nanovllm.kernels.linear.w8a8_swap import fits_w8a8_swap, w8a8_swap

DECODE_TOKENS = 16  # up to here fp8_linear runs W8A16 split over K (weight_stages' FP8 range)
SWAP_TOKENS = 128  # W8A8 swapped up to here, cuBLAS above; at 256 they were as fast


@triton.jit
def _w8a8_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K, group_n, group_k,
                      stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """c[m, n] = sum over K steps of (a . b^T) * a_scale[m, step] * b_scale[n // gn, step]:
    BLOCK_K divides group_k, so every step lies in one scale group."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BK, BN]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // group_n).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        a = tl.load(a_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a_s = tl.load(as_ptrs + k0 // group_k, mask=m_mask, other=0.0)
        b_s = tl.load(bs_ptrs + k0 // group_k, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _tiles(m: int, group_k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages): narrow N tiles for decode-sized M, so that a few
    tokens still give the GPU many programs; K steps of at most 128 that divide a power-of-two
    group (a per-channel group, all of K, has one scale for every step)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 256 else 128
    block_n = 64 if m <= 64 else 128
    return block_m, block_n, min(triton.next_power_of_2(group_k), 128), 4 if m <= 64 else 3


def w8a8_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
              weight_scale: torch.Tensor, groups: tuple[int, int], bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] and weight [N, K] FP8 codes with their group scales -> [M, N] in out_dtype;
    groups (gn, gk) of the weight's scales, and a's groups span gk too."""
    m, k = a.shape
    n = weight.shape[0]
    group_n, group_k = groups
    assert weight.stride(1) == 1 and a.stride(1) == 1 and weight_scale.stride(1) == 1
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    block_m, block_n, block_k, stages = _tiles(m, group_k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_gemm_kernel[grid](
        a, weight, c, a_scale, weight_scale, bias if bias is not None else c, m, n, k,
        group_n, group_k, a.stride(0), weight.stride(0), c.stride(0), a_scale.stride(0),
        weight_scale.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4, num_stages=stages)
    return c


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether cuBLAS's rowwise-scaled FP8 GEMM takes these: CUDA, K and N multiples of 16, a
    16-bit output."""
    n, k = weight.shape
    return x.is_cuda and k % 16 == 0 and n % 16 == 0 and out_dtype in (torch.bfloat16,
                                                                         torch.float16)


def _runs_split_k(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether fp8_linear takes split-K W8A16: 1 to DECODE_TOKENS rows, shapes it takes, and
    TMA (sm_90 and newer, or the CPU interpreter, which emulates it)."""
    # the row count first: a prefill step's call stops there, before any device query
    if not 0 < x.shape[0] <= DECODE_TOKENS or not weight.is_contiguous():
        return False
    n, k = weight.shape
    return _has_tma(x.device) and fits_split_k(k, n, x.dtype, weight.dtype, block)


def _runs_swap(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether fp8_linear takes the swapped W8A8 GEMM: with TMA, for shapes it takes; per
    channel up to SWAP_TOKENS (cuBLAS from there), block-scaled at any size cuBLAS's
    block-scaled GEMM did not take (our other GEMM, w8a8_gemm, took twice as long at 256
    tokens)."""
    n, k = weight.shape
    return 0 < x.shape[0] and (block is not None or x.shape[0] <= SWAP_TOKENS) \
        and fits_w8a8_swap(n, k, block) and weight.is_contiguous() and _has_tma(x.device)


@functools.cache
def _has_block_scaled_mm(device: torch.device) -> bool:
    """cuBLAS's 1x128-by-128x128 block-scaled FP8 GEMM: sm_90 with CUDA 12.9 or newer."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    return torch.cuda.get_device_capability(device) == (9, 0) and cuda >= (12, 9)


def _runs_block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          block: tuple[int, int] | None) -> bool:
    """Whether fp8_linear takes cuBLAS's block-scaled GEMM: [128, 128] blocks, more than
    SWAP_TOKENS tokens, whole blocks, a multiple of 4 along K, bf16, contiguous operands."""
    n, k = weight.shape
    # K blocks a multiple of 4: cuBLAS's scale layout without padding (with it, 5 blocks
    # were refused); real models' K are (2,048, 4,096, 12,288, 14,336, ...). bf16 only: the
    # output dtype it was measured and tested with
    return block is not None and tuple(block) == (128, 128) and x.shape[0] > SWAP_TOKENS \
        and n % 128 == 0 and k % 512 == 0 and x.dtype == torch.bfloat16 \
        and weight.is_contiguous() and weight_scale.is_contiguous() \
        and _has_block_scaled_mm(x.device)


def block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 times weight [N, K] with [128, 128] block scales through cuBLAS: x
    quantized per 128-column group, its codes and scales padded to a multiple of 4 rows and
    the scales outer-major (cuBLAS's layout); the weight's scales [N/128, K/128] read
    transposed."""
    m = x.shape[0]
    codes, scales = per_token_group_quant(x, 128, outer_major=True, rows_multiple=4)
    y = torch._scaled_mm(codes, weight.t(), scale_a=scales, scale_b=weight_scale.t(),
                         out_dtype=x.dtype)[:m]
    return y.add_(bias) if bias is not None else y


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """sm_90 and newer, or the CPU interpreter, which emulates TMA (asked once a device)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def takes_token_codes(num_tokens: int, block: tuple[int, int] | None) -> bool:
    """Whether fp8_linear quantizes num_tokens rows per token over all of K, so that the op
    before may hand it TokenCodes instead: per-channel weights above DECODE_TOKENS."""
    return block is None and num_tokens > DECODE_TOKENS


def fp8_linear(x: torch.Tensor | TokenCodes, weight: torch.Tensor, weight_scale: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x W^T (+ b) in x's dtype, as kernels.linear.fp8_reference.fp8_linear_torch (W8A8); x
    [..., K]. Up to DECODE_TOKENS tokens W8A16 (activations unquantized), where split-K takes
    the shapes; one token per channel as whole-row GEMVs (kernels.linear.gemv). x may be its
    TokenCodes (steps takes_token_codes takes), out_dtype then the output's dtype."""
    if isinstance(x, TokenCodes):
        assert takes_token_codes(x.shape[0], block) and out_dtype is not None
        return _w8a8(*x, weight, weight_scale, block, bias, out_dtype)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if runs_gemv_rows(x2, weight, weight_scale, block):  # one token: no partials to sum
        return gemv_rows(x2, weight, bias, weight_scale).reshape(*x.shape[:-1], n)
    if _runs_split_k(x2, weight, block):
        part = split_k_linear(x2, weight, w_scale=weight_scale, w_block=block)
        return sum_partials(part, x.dtype, bias).reshape(*x.shape[:-1], n)
    if _runs_block_scaled_mm(x2, weight, weight_scale, block):
        return block_scaled_mm(x2, weight, weight_scale, bias).reshape(*x.shape[:-1], n)
    codes, scales = per_token_group_quant(x2, block[1] if block is not None else k)
    y = _w8a8(codes, scales, weight, weight_scale, block, bias, x.dtype)
    return y.reshape(*x.shape[:-1], n)


def _w8a8(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
          weight_scale: torch.Tensor, block: tuple[int, int] | None, bias: torch.Tensor | None,
          out_dtype: torch.dtype) -> torch.Tensor:
    """[M, N] in out_dtype of activations quantized per token group (codes [M, K], scales)
    and the weight's codes: the swapped GEMM, cuBLAS's rowwise GEMM or our own."""
    n, k = weight.shape
    if _runs_swap(codes, weight, block):
        return w8a8_swap(codes, scales, weight, weight_scale, block, bias, out_dtype)
    if block is None and _scaled_mm_fits(codes, weight, out_dtype):
        # fast accumulation, as vLLM's FP8 GEMMs on sm_90: the MMA's own accumulator over all
        # of K, no promotion to float32 between steps (twice the error, docs/quantization.md)
        return torch._scaled_mm(codes, weight.t(), scale_a=scales,
                                scale_b=weight_scale.view(1, n), bias=bias, out_dtype=out_dtype,
                                use_fast_accum=True)
    groups = block if block is not None else (1, k)
    return w8a8_gemm(codes, scales, weight, weight_scale, groups, bias, out_dtype)

