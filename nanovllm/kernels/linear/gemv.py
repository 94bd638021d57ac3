"""One-token decode projections on CUDA cores (GEMV): whole rows (qkv_proj, an FP8 linear's)
for a decode step of a single token, and the helpers its kin share: split_k_linear's partials
in kernels.linear.gemv_partials, gate_up_proj with SiLU-and-mul in kernels.linear.gemv_gate_up.

A one-token step reads each weight once and multiplies it by one row, so the MMA's tiles buy
nothing there; what bounds it is how early the weight's bytes arrive. Each program here loads
its whole weight slice (16 to 64 KB) into registers *before* its PDL wait, while the kernel
before still runs (no kernel writes a weight), then waits for x and reduces. Chained over 32
weights on the H200 (`python -m benchmarks.gemv_probe`, 2026-12-05), against the MMA kernels:
Llama-3.1-8B FP8 gate_up + SiLU 28.2 against 34.1 us (bytes 27.5), down_proj 15.7 against
18.9, qkv_proj 7.6 against 9.6; Qwen3-0.6B bf16 gate_up + SiLU 5.0 against 6.0, o_proj 2.4
against 2.9. At 4 tokens a GEMV of this kind lost to the MMA kernels at every shape.

FP8 codes (per-channel scales only) convert to float32 in registers, as 16-bit weights do; the
activations stay unquantized (W8A16, as kernels.linear.fused_fp8 argues).

Whole rows may first compute the add + RMSNorm before them (kernels.linear.norm_prologue):
norm_gemv_rows, for the next layer's qkv_proj after down_proj's partials.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE
from nanovllm.kernels.fused_ops import load_row, rms_scaled
from nanovllm.kernels.linear.fused_fp8 import fits_weight
from nanovllm.kernels.linear.norm_prologue import (
    PendingNorm,
    cheap_enough,
    prologue_args,
    takes_norm,
)
from nanovllm.kernels.pdl import launch_options, wait_then_release

SLICE_BYTES = 16 * 1024  # weight bytes a partials program holds (the probe's best, 16-32 KB)
WHOLE_ROWS_BYTES = SLICE_BYTES  # whole weight rows a gemv_rows program holds (all of K)
# ... and the weight elements one of norm_gemv_rows holds, with 8 warps (64 KB of 16-bit
# weights, 32 KB of FP8 codes: the same rows at the same K): every program reads all the
# partials, so fewer programs (Qwen3-0.6B's qkv_proj: 128, not 512) for cheap_enough to hold
NORM_ROWS_ELEMENTS = 32 * 1024


# Loads before the PDL wait, of what no kernel writes (weights, their scales, biases, norm
# weights): the kernels call only these before it (tests/kernels/test_pdl.py scans the
# kernels, not these).
@triton.jit
def rows_slice(w_ptr, rows, ks, K, stride_w):
    """W[rows, ks] of a [N, K] weight, zeros past K."""
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + ks[None, :],
                   mask=ks[None, :] < K, other=0.0)


@triton.jit
def row_values(ptr, rows, PRESENT: tl.constexpr):
    """float32 ptr[rows] (per-channel scales, a bias) when PRESENT, else zeros (never used)."""
    if PRESENT:
        values = tl.load(ptr + rows).to(tl.float32)
    else:
        values = tl.zeros(rows.shape, tl.float32)
    return values


@triton.jit
def rms_weight(w_ptr, ks, K, PARTIALS: tl.constexpr):
    """float32 RMSNorm weight w[ks] (zeros past K) when PARTIALS, else zeros (never used)."""
    if PARTIALS:
        w = tl.load(w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    else:
        w = tl.zeros(ks.shape, tl.float32)
    return w


# After the wait: the input row, normed there when the partials before come instead
@triton.jit
def gemv_input(x_ptr, res_ptr, res_out_ptr, norm_w, ks, K, eps, dtype: tl.constexpr,
               PARTIALS: tl.constexpr):
    """float32 x [1, K_P2]: x, or with PARTIALS add_partials_rms_norm's of x's partials."""
    # x's PARTIALS split-K partials summed + the residual, normalised as add_partials_rms_norm
    # does; program 0 also stores the sum (the next residual)
    mask = ks < K
    if PARTIALS:
        h = load_row(x_ptr, res_ptr, 0, ks, mask, 0, 0, K, dtype, True, PARTIALS)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + ks, h.to(dtype), mask=mask)
        x, _ = rms_scaled(h, norm_w, eps, K, dtype)
    else:
        x = tl.load(x_ptr + ks, mask=mask, other=0.0)
    return x.to(tl.float32)[None, :]


@triton.jit
def _gemv_rows_kernel(w_ptr, x_ptr, s_ptr, bias_ptr, out_ptr, K, stride_w, res_ptr, norm_w_ptr,
                      res_out_ptr, eps, BLOCK_N: tl.constexpr, K_P2: tl.constexpr,
                      W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIALS: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """Grid (N / BLOCK_N,): out[rows] = x . W[rows, :] (* s[rows]) (+ b[rows]), all of K in one
    program, rounded once: no partials, so no launch after it sums them. With PARTIALS, x is
    the RMSNorm of the projection before's partials plus the residual, normalised by every
    program for itself: the norm's own launch and its wait go (gemv_input)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_P2)
    w = rows_slice(w_ptr, rows, ks, K, stride_w)
    scale = row_values(s_ptr, rows, W_SCALE)
    bias = row_values(bias_ptr, rows, HAS_BIAS)
    norm_w = rms_weight(norm_w_ptr, ks, K, PARTIALS)
    wait_then_release(USE_PDL)
    dtype = out_ptr.dtype.element_ty
    x = gemv_input(x_ptr, res_ptr, res_out_ptr, norm_w, ks, K, eps, dtype, PARTIALS)
    y = tl.sum(w.to(tl.float32) * x, 1)
    if W_SCALE:
        y *= scale
    if HAS_BIAS:
        y += bias
    tl.store(out_ptr + rows, y.to(dtype))


def weight_ok(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None,
              w_block) -> bool:
    """One token of 16-bit activations, K wide, and a weight fits_weight takes without block
    scales: FP8 codes come with one float32 scale per output channel ([N, 1])."""
    return x.shape == (1, weight.shape[1]) and x.stride(1) == 1 \
        and dtype_ok(x.dtype, weight, w_scale, w_block)


def dtype_ok(x_dtype: torch.dtype, weight: torch.Tensor, w_scale: torch.Tensor | None,
             w_block) -> bool:
    """weight_ok's checks of the activations' dtype and the weight."""
    if w_block is not None or not fits_weight(x_dtype, weight.dtype, None):
        return False
    if weight.dtype != FP8_DTYPE:
        return w_scale is None
    return w_scale is not None and w_scale.is_contiguous() \
        and w_scale.dtype == torch.float32 and w_scale.shape == (weight.shape[0], 1)


def _rows_per_program(weight: torch.Tensor, norm: PendingNorm | None = None) -> int | None:
    """Weight rows per whole-row program, all of K: WHOLE_ROWS_BYTES, or with norm
    NORM_ROWS_ELEMENTS; None if one row is wider than that, or the rows do not divide N."""
    n, k = weight.shape
    elements = WHOLE_ROWS_BYTES // weight.element_size() if norm is None else NORM_ROWS_ELEMENTS
    block_n = elements // triton.next_power_of_2(k)
    return block_n if block_n >= 1 and n % block_n == 0 else None


def runs_gemv_rows(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None = None,
                   w_block=None) -> bool:
    """Whether gemv_rows takes this step: weight [N, K] contiguous, a row within
    WHOLE_ROWS_BYTES."""
    return weight_ok(x, weight, w_scale, w_block) and weight.is_contiguous() \
        and _rows_per_program(weight) is not None


def launch_whole_rows(kernel, sizes: tuple, out_cols: int, block_n: int, num_warps: int,
                      x: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                      w_scale: torch.Tensor | None, norm: PendingNorm | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [1, out_cols], norm's sum or None) of a whole-row kernel on x or norm's normed sum."""
    # the kernel takes _gemv_rows_kernel's parameters, `sizes` between out_ptr and stride_w
    src, norm_args, res_out, partials = prologue_args(x, norm)
    like = x if norm is None else norm.residual
    out = torch.empty(1, out_cols, dtype=like.dtype, device=like.device)
    kernel[(out_cols // block_n,)](
        weight, src, weight if w_scale is None else w_scale, weight if bias is None else bias,
        out, *sizes, weight.stride(0), *norm_args, BLOCK_N=block_n,
        K_P2=triton.next_power_of_2(weight.shape[1]), W_SCALE=w_scale is not None,
        HAS_BIAS=bias is not None, PARTIALS=partials, num_warps=num_warps, **launch_options())
    return out, res_out


def _rows_launch(x: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                 w_scale: torch.Tensor | None, norm: PendingNorm | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x @ weight.T (+ bias), or of norm's normed sum; that sum, the next residual, or None)."""
    n, k = weight.shape
    return launch_whole_rows(_gemv_rows_kernel, (k,), n, _rows_per_program(weight, norm),
                             4 if norm is None else 8, x, weight, bias, w_scale, norm)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), [1, N] in x's dtype, for one token (as runs_gemv_rows takes it)."""
    return _rows_launch(x, weight, bias, w_scale)[0]


def runs_norm_gemv_rows(norm: PendingNorm, weight: torch.Tensor,
                        w_scale: torch.Tensor | None = None, w_block=None) -> bool:
    """Whether norm_gemv_rows takes this step (as runs_gemv_rows, the reads cheap_enough)."""
    # rows of NORM_ROWS_ELEMENTS a program, partials the kernel takes (takes_norm)
    block_n = _rows_per_program(weight, norm)
    return weight_ok(norm.residual, weight, w_scale, w_block) and weight.is_contiguous() \
        and block_n is not None and takes_norm(norm) \
        and cheap_enough(norm, weight.shape[0] // block_n, weight)


def norm_gemv_rows(norm: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None,
                   w_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv_rows(h), the sum) for (h, the sum) = add_partials_rms_norm(*norm), in one kernel."""
    return _rows_launch(None, weight, bias, w_scale, norm)
