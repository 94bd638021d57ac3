"""A lone token's whole MLP in one launch: the add + RMSNorm of o_proj's partials, gate_up +
SiLU (kernels.linear.gemv_gate_up's programs) and down_proj, each program multiplying its few
SiLU outputs by their rows of the k-major down weight and adding the product, a whole output
row, into one of SPLITS float32 partial rows with atomics. Those rows are down_proj's split-K
partials as the next layer's qkv_proj GEMV (or the final norm) sums them, so the down GEMV's
launch goes. How the rows start at zero: kernels.linear.mlp_partials.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.linear.gemv import gemv_input, rms_weight, row_values, rows_slice
from nanovllm.kernels.linear.gemv_gate_up import _pair_rows, _pair_slices, silu_of_pair
from nanovllm.kernels.linear.mlp_partials import SPLITS, MlpPartials
from nanovllm.kernels.linear.norm_prologue import PendingNorm, cheap_enough, takes_norm
from nanovllm.kernels.pdl import launch_options, wait_then_release

MAX_DOWN_BYTES = 32 * 1024  # down weight bytes a program holds beside its gate and up rows


@triton.jit
def _gate_up_down_kernel(w_ptr, wd_ptr, bias_ptr, part_ptr, clear_ptr, x_ptr, K, inter, N,
                         stride_w, stride_wd, res_ptr, norm_w_ptr, res_out_ptr, eps,
                         BLOCK_N: tl.constexpr, K_P2: tl.constexpr, N_P2: tl.constexpr,
                         PARTIALS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         CLEAR: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (inter / BLOCK_N,): h = silu(gate) * up for BLOCK_N columns of the token normed from
    o_proj's PARTIALS partials and the residual (gemv_gate_up's rounding), then
    part[pid % NUM_SPLITS] += h . Wd[cols, :] (wd: the k-major down weight, [inter, N]); each
    program also zeroes its CLEAR floats of clear_ptr."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K_P2)
    ns = tl.arange(0, N_P2)
    g, u = _pair_slices(w_ptr, cols, ks, K, inter, stride_w)
    wd = rows_slice(wd_ptr, cols, ns, N, stride_wd)
    g_bias = row_values(bias_ptr, cols, HAS_BIAS)
    u_bias = row_values(bias_ptr, inter + cols, HAS_BIAS)
    norm_w = rms_weight(norm_w_ptr, ks, K, True)
    wait_then_release(USE_PDL)
    dtype = res_out_ptr.dtype.element_ty
    x = gemv_input(x_ptr, res_ptr, res_out_ptr, norm_w, ks, K, eps, dtype, PARTIALS)
    h = silu_of_pair(g, u, x, g_bias, u_bias, g_bias, u_bias, dtype, False,
                     HAS_BIAS).to(tl.float32)
    y = tl.sum(wd.to(tl.float32) * h[:, None], 0)
    offs = pid * CLEAR + tl.arange(0, CLEAR)
    tl.store(clear_ptr + offs, tl.zeros([CLEAR], tl.float32), mask=offs < NUM_SPLITS * N)
    tl.atomic_add(part_ptr + (pid % NUM_SPLITS) * N + ns, y, mask=ns < N, sem="relaxed")


def _down_rows_ok(down_weight: torch.Tensor, block_n: int, dtype: torch.dtype) -> bool:
    """Whether a program's block_n rows of the k-major down weight [N, inter] fit."""
    n = down_weight.shape[0]
    return down_weight.dtype == dtype and down_weight.t().is_contiguous() \
        and block_n * triton.next_power_of_2(n) * down_weight.element_size() <= MAX_DOWN_BYTES


def runs_gate_up_down_gemv(norm: PendingNorm, weight: torch.Tensor,
                           down_weight: torch.Tensor) -> bool:
    """Whether gate_up_down_gemv takes this step: one token of 16-bit weights (gate_up [2I, K]
    contiguous, down k-major), partials the kernel takes, and their reads cheap_enough."""
    residual = norm.residual
    inter, k = weight.shape[0] // 2, weight.shape[1]
    if residual.shape != (1, k) or weight.dtype != residual.dtype or not weight.is_contiguous() \
            or down_weight.shape[1] != inter or not takes_norm(norm):
        return False
    block_n = _pair_rows(inter, k, weight.element_size())
    return block_n is not None and _down_rows_ok(down_weight, block_n, residual.dtype) \
        and cheap_enough(norm, inter // block_n, weight)


def gate_up_down_gemv(norm: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None,
                      down_weight: torch.Tensor, rows: MlpPartials, parity: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(down_proj's float32 partials [SPLITS, 1, N] of silu(gate) * up of the normed sum, the
    sum) for a step runs_gate_up_down_gemv takes: the model's rows, the layer's parity."""
    residual = norm.residual
    inter, k = weight.shape[0] // 2, weight.shape[1]
    n = down_weight.shape[0]
    block_n = _pair_rows(inter, k, weight.element_size())
    part, clear = rows.pair(parity, residual)
    programs = inter // block_n
    res_out = torch.empty_like(residual)
    _gate_up_down_kernel[(programs,)](
        weight, down_weight.t(), weight if bias is None else bias, part, clear, norm.partials,
        k, inter, n, weight.stride(0), down_weight.t().stride(0), residual, norm.weight, res_out,
        norm.eps, BLOCK_N=block_n, K_P2=triton.next_power_of_2(k),
        N_P2=triton.next_power_of_2(n), PARTIALS=norm.partials.shape[0], NUM_SPLITS=SPLITS,
        CLEAR=triton.next_power_of_2(triton.cdiv(SPLITS * n, programs)),
        HAS_BIAS=bias is not None, num_warps=4, **launch_options())
    return part, res_out
