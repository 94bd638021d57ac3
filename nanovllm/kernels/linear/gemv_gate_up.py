"""One-token gate_up_proj with SiLU-and-mul on CUDA cores (kernels.linear.gemv's approach: each
program loads its gate and up rows, all of K, before its PDL wait), optionally with the add +
RMSNorm before it computed in every program from o_proj's split-K partials, so that the norm
needs no launch of its own (kernels.linear.norm_prologue).
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.linear.gemv import (
    gemv_input,
    launch_whole_rows,
    rms_weight,
    row_values,
    rows_slice,
    weight_ok,
)
from nanovllm.kernels.linear.norm_prologue import PendingNorm, cheap_enough, takes_norm
from nanovllm.kernels.pdl import wait_then_release

PAIR_BYTES = 32 * 1024  # gate + up bytes a SiLU program holds (all of K)


@triton.jit
def silu_and_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in dtype, rounded as the unfused path: each projection, then silu in
    float32, then the product (gate and up: float32 sums)."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _pair_slices(w_ptr, cols, ks, K, inter, stride_w):
    """(W[cols, ks], W[inter + cols, ks]) of a gate_up weight, zeros past K."""
    return rows_slice(w_ptr, cols, ks, K, stride_w), \
        rows_slice(w_ptr + inter * stride_w, cols, ks, K, stride_w)


@triton.jit
def silu_of_pair(g, u, x, g_scale, u_scale, g_bias, u_bias, dtype: tl.constexpr,
                 W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """silu(gate) * up in dtype for x [1, K] and the gate and up rows g, u [BLOCK_N, K]
    (scaled per channel with W_SCALE, biased with HAS_BIAS), rounded as the unfused path."""
    gate = tl.sum(g.to(tl.float32) * x, 1)
    up = tl.sum(u.to(tl.float32) * x, 1)
    if W_SCALE:
        gate *= g_scale
        up *= u_scale
    if HAS_BIAS:
        gate += g_bias
        up += u_bias
    return silu_and_mul_rounded(gate, up, dtype)


@triton.jit
def _gate_up_silu_kernel(w_ptr, x_ptr, s_ptr, bias_ptr, out_ptr, K, inter, stride_w, res_ptr,
                         norm_w_ptr, res_out_ptr, eps, BLOCK_N: tl.constexpr,
                         K_P2: tl.constexpr, W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PARTIALS: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (inter / BLOCK_N,): silu(gate) * up for BLOCK_N columns of one token, all of K in
    one program (gate rows W[:inter], up rows W[inter:]), rounded as the unfused path. With
    PARTIALS, x is the RMSNorm of o_proj's partials plus the residual, normalised by every
    program for itself: the norm's own launch and its wait go (gemv_input)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_P2)
    g, u = _pair_slices(w_ptr, cols, ks, K, inter, stride_w)
    g_scale = row_values(s_ptr, cols, W_SCALE)
    u_scale = row_values(s_ptr, inter + cols, W_SCALE)
    g_bias = row_values(bias_ptr, cols, HAS_BIAS)
    u_bias = row_values(bias_ptr, inter + cols, HAS_BIAS)
    norm_w = rms_weight(norm_w_ptr, ks, K, PARTIALS)
    wait_then_release(USE_PDL)
    dtype = out_ptr.dtype.element_ty
    x = gemv_input(x_ptr, res_ptr, res_out_ptr, norm_w, ks, K, eps, dtype, PARTIALS)
    h = silu_of_pair(g, u, x, g_scale, u_scale, g_bias, u_bias, dtype, W_SCALE, HAS_BIAS)
    tl.store(out_ptr + cols, h)


def _pair_rows(inter: int, k: int, elem_bytes: int) -> int | None:
    """Gate (and as many up) rows per SiLU program: PAIR_BYTES of all of K; None if one row pair
    is wider than that, or the rows do not divide inter."""
    block_n = PAIR_BYTES // (2 * triton.next_power_of_2(k) * elem_bytes)
    return block_n if block_n >= 1 and inter % block_n == 0 else None


def runs_gate_up_gemv(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None = None,
                      w_block=None) -> bool:
    """Whether gate_up_silu_gemv takes this step (weight [2I, K] contiguous)."""
    return weight_ok(x, weight, w_scale, w_block) and weight.is_contiguous() \
        and _pair_rows(weight.shape[0] // 2, weight.shape[1], weight.element_size()) is not None


def _gate_up_launch(x: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                    w_scale: torch.Tensor | None, norm: PendingNorm | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(silu(gate) * up of x, or of norm's normed sum; that sum, the next residual, or None)."""
    inter, k = weight.shape[0] // 2, weight.shape[1]
    return launch_whole_rows(_gate_up_silu_kernel, (k, inter), inter,
                             _pair_rows(inter, k, weight.element_size()), 4, x, weight, bias,
                             w_scale, norm)


def gate_up_silu_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ Wg.T + bg) * (x @ Wu.T + bu), [1, I], as fused_gate_up.gate_up_silu."""
    return _gate_up_launch(x, weight, bias, w_scale)[0]


def runs_norm_gate_up_gemv(norm: PendingNorm, weight: torch.Tensor,
                           w_scale: torch.Tensor | None = None, w_block=None) -> bool:
    """Whether norm_gate_up_silu_gemv takes this step: runs_gate_up_gemv's for the residual,
    partials it takes, and their reads cheap_enough."""
    if not (runs_gate_up_gemv(norm.residual, weight, w_scale, w_block) and takes_norm(norm)):
        return False
    inter = weight.shape[0] // 2
    programs = inter // _pair_rows(inter, weight.shape[1], weight.element_size())
    return cheap_enough(norm, programs, weight)


def norm_gate_up_silu_gemv(norm: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None,
                           w_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_silu_gemv(h), the sum) for (h, the sum) = add_partials_rms_norm(*norm), the
    norm computed in every program of the GEMV, as that kernel computes it."""
    return _gate_up_launch(None, weight, bias, w_scale, norm)
