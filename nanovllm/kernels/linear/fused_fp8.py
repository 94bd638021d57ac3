"""FP8 weights in kernels.linear.fused's decode projections: the scale layouts the kernels take,
their launch arguments, and the Triton helpers that apply the scales.

Decode runs FP8 weights as W8A16, not as the W8A8 of kernels.linear.fp8_gemm: each FP8 weight tile
arrives by TMA as a 16-bit one does, is converted to the activations' dtype in registers (every
e4m3 value is exact in bf16 and fp16) and multiplied with the unquantized activations; the
float32 accumulator takes the weight's scale. Why at decode:
- no activation-quantization kernel: W8A8 would need one before every projection, a launch
  the fused epilogues exist to save;
- more accurate than W8A8: the activations keep their 16 bits instead of e4m3's 3 mantissa bits;
- no slower: a decode step's few tokens make the GEMM bound by the weight's bytes, which FP8
  halves either way; the MMA's input dtype does not matter there.

The two scale layouts of layers.quantization.fp8 (kernels.linear.fp8_reference dequantizes them):

    per output channel  scale [N, 1]: the accumulator's rows times their scales, once after
                        the K loop
    per block (bn, bk)  scale [cdiv(N, bn), cdiv(K, bk)]: each K step's product times its
                        block's scale; bk must be the K step (K_STEP) and bn a multiple of 64,
                        so that one 64-row tile's step lies in one block (fits_weight)

The kernels take a weight's scales as (s_ptr, stride_s, scale_rows): weight row r's scales
start at s_ptr + r // scale_rows * stride_s (scale_args).
"""
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE
from nanovllm.kernels.linear.fp8_reference import cdiv

K_STEP = 128  # every fused projection's BLOCK_K (fused._launch, split_k.split_k_linear)
TILE_ROWS = 64  # weight rows of one MMA tile (fused.ROWS and split_k.ROWS are this)
# The kernels' W_SCALE: a 16-bit weight (no scale), or FP8 codes scaled per channel or block
NO_SCALE = tl.constexpr(0)
PER_CHANNEL = tl.constexpr(1)
PER_BLOCK = tl.constexpr(2)


Block = tuple[int, int] | None  # (rows, cols) of weight one FP8 scale covers; None: a channel


def weight_stages(num_tokens: int, weight: torch.Tensor) -> int:
    """Pipeline stages of a fused projection's K loop without LoRA: 4, or 8 for FP8 codes up to
    16 tokens, whose tiles are half a 16-bit tile's bytes, so twice the stages keep as many
    bytes in flight (at 128 tokens the x tile alone is 32 KB: 8 stages need 320 KB of the
    H200's 227 KB of shared memory)."""
    return 8 if weight.dtype == FP8_DTYPE and num_tokens <= 16 else 4


# Shared memory a program's pipeline may fill (the H200's 227 KB a block, less the epilogue's)
PIPELINE_BYTES = 220 * 1024


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SMs; 0 off CUDA (no residency limit)."""
    return torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 0


def resident_stages(stages: int, programs: int, sms: int, stage_bytes: int,
                    fixed_bytes: int = 0) -> int:
    """At most `stages`, as many as keep all `programs` resident at once (at least 2), each
    also holding fixed_bytes outside its pipeline: one wave, not a second, partial one behind
    the first."""
    if not sms or programs <= sms:
        return stages
    per_program = PIPELINE_BYTES // -(-programs // sms) - fixed_bytes
    return max(2, min(stages, per_program // stage_bytes))


def fits_weight(dtype: torch.dtype, weight_dtype: torch.dtype, block: Block) -> bool:
    """Whether the fused kernels take a weight of weight_dtype for activations of dtype: the
    activations' own 16-bit dtype, or FP8 codes with per-channel scales (block None) or block
    scales K_STEP columns wide and a multiple of 64 rows high. (An FP8 row of K codes is K
    bytes: the fits_* checks' K % 64 keeps it the 16-byte multiple TMA needs.)"""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if weight_dtype != FP8_DTYPE:
        return weight_dtype == dtype and block is None
    return block is None or (block[0] % TILE_ROWS == 0 and block[1] == K_STEP)


def scale_args(weight: torch.Tensor, w_scale: torch.Tensor | None,
               w_block: Block) -> tuple[torch.Tensor, int, int, int]:
    """(scales, their row stride, weight rows per scale row, W_SCALE) for a kernel launch; a
    16-bit weight passes itself as the scales (never read). weight: [N, K] as logically seen."""
    if w_scale is None:
        assert weight.dtype != FP8_DTYPE, "FP8 weights come with their w_scale"
        return weight, 0, 1, NO_SCALE.value
    n, k = weight.shape
    assert weight.dtype == FP8_DTYPE, f"w_scale given for a {weight.dtype} weight"
    assert w_scale.dtype == torch.float32 and w_scale.is_contiguous(), w_scale.dtype
    if w_block is None:
        assert w_scale.shape == (n, 1), f"per-channel scales of [{n}, {k}]: {w_scale.shape}"
        return w_scale, 1, 1, PER_CHANNEL.value
    block_n, block_k = w_block
    assert block_k == K_STEP and block_n % TILE_ROWS == 0, w_block
    assert w_scale.shape == (cdiv(n, block_n), cdiv(k, block_k)), (w_scale.shape, w_block)
    return w_scale, w_scale.stride(0), block_n, PER_BLOCK.value


@triton.jit
def as_fp16(x):
    """x in float16, bf16 saturated at float16's largest finite value (bf16 values inside it
    convert exactly, but for those below float16's normal range)."""
    if x.dtype == tl.bfloat16:
        x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return x


@triton.jit
def scaled_dot(w, x, acc, s_row, k, BLOCK_K: tl.constexpr, W_SCALE: tl.constexpr):
    """acc + w @ x for a weight tile w [64, BLOCK_K] and activations x [BLOCK_K, T]: FP8 codes
    and activations as float16 first (sm_90 converts e4m3 pairs to float16 in one instruction,
    to bf16 in three) and, per block, the step's product times its block's scale (s_row: the
    tile's row of block scales; k: the step's first column)."""
    if W_SCALE == PER_BLOCK:
        acc += tl.dot(w.to(tl.float16), as_fp16(x)) * tl.load(s_row + k // BLOCK_K)
    elif W_SCALE == PER_CHANNEL:  # its scales multiply the accumulator after the loop
        acc = tl.dot(w.to(tl.float16), as_fp16(x), acc)
    else:
        acc = tl.dot(w, x, acc)
    return acc


@triton.jit
def channel_scales(s_row, W_SCALE: tl.constexpr):
    """Per channel: the scales [64, 1] of the 64 rows from s_row (requested before the K loop,
    so that their latency hides behind it); any other weight: ones that are never used (a
    tensor either way, which every Triton version returns; the compiler drops it)."""
    if W_SCALE == PER_CHANNEL:
        scales = tl.load(s_row + tl.arange(0, 64))[:, None]
    else:
        scales = tl.full([64, 1], 1.0, tl.float32)
    return scales


@triton.jit
def channel_scaled(acc, scales, W_SCALE: tl.constexpr):
    """Per channel: acc [64, T] times its rows' scales (channel_scales); else acc unchanged."""
    if W_SCALE == PER_CHANNEL:
        acc *= scales
    return acc
