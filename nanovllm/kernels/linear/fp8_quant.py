"""Dynamic FP8 activation quantization: per token in groups (per_token_group_quant, as
kernels.linear.fp8_reference.per_token_group_quant_torch), and the scale and codes formula that
every kernel writing FP8 activations shares (fp8_scale, fp8_codes)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.linear.fp8_reference import FP8_DTYPE, FP8_MAX, SCALE_EPS

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def fp8_scale(amax, eps):
    """The float32 scale of a group whose largest magnitude is amax (at least eps)."""
    return tl.maximum(amax, eps) / _FP8_MAX


@triton.jit
def fp8_codes(x, scale):
    """float32 x / scale clamped to float8_e4m3fn's range (the caller casts and stores)."""
    return tl.clamp(x / scale, -_FP8_MAX, _FP8_MAX)


# the rows and the outer-major scales' group stride (the rows) change with the batch
@triton.jit(do_not_specialize=["M", "M_OUT", "stride_sg"])
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, group, num_groups, stride_xm,
                        stride_qm, stride_sm, stride_sg, eps, ROWS: tl.constexpr,
                        GROUPS: tl.constexpr, GROUP_P2: tl.constexpr):
    """Grid (row blocks, group blocks): ROWS x GROUPS token groups read once; scale = max|x| /
    448 over each group, codes = x / scale. Rows M..M_OUT (padding) get zero codes."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, GROUP_P2)
    cols = gs[None, :, None] * group + j[None, None, :]
    live = (rows[:, None] < M_OUT) & (gs[None, :] < num_groups)
    mask = live[:, :, None] & (j[None, None, :] < group) & (cols < K)
    r64 = rows.to(tl.int64)[:, None, None]
    x = tl.load(x_ptr + r64 * stride_xm + cols, mask=mask & (r64 < M), other=0.0
                ).to(tl.float32)
    scale = fp8_scale(tl.max(tl.abs(x), axis=2), eps)
    q = fp8_codes(x, scale[:, :, None])
    tl.store(q_ptr + r64 * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    s_ptrs = s_ptr + rows.to(tl.int64)[:, None] * stride_sm + gs[None, :] * stride_sg
    tl.store(s_ptrs, scale, mask=live)


@triton.jit(do_not_specialize=["M", "stride_sg"])
def _long_group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, group, stride_xm, stride_qm,
                             stride_sm, stride_sg, eps, BLOCK: tl.constexpr):
    """Grid (rows with padding, groups), for groups wider than QUANT_ROW_MAX: two passes over
    the group; rows from M (padding) get zero codes."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * group
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, group, BLOCK):
        offs = start + k0 + tl.arange(0, BLOCK)
        mask = (k0 + tl.arange(0, BLOCK) < group) & (offs < K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask & (row < M), other=0.0
                    ).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_scale(tl.max(amax, 0), eps)
    for k0 in range(0, group, BLOCK):
        offs = start + k0 + tl.arange(0, BLOCK)
        mask = (k0 + tl.arange(0, BLOCK) < group) & (offs < K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask & (row < M), other=0.0
                    ).to(tl.float32)
        q = fp8_codes(x, scale)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + tl.program_id(1) * stride_sg, scale)


# Elements one quantization program holds: 4,096 for narrow groups (rows x groups of them), a
# whole group up to 16,384 (a per-token row of Llama-3.1-8B's down_proj input)
QUANT_TILE, QUANT_ROW_MAX = 4096, 16384


def per_token_group_quant(x: torch.Tensor, group: int, outer_major: bool = False,
                          rows_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (codes [M, K] float8, scales [M, ceil(K/group)] float32), as
    kernels.linear.fp8_reference.per_token_group_quant_torch. outer_major: the scales' rows
    adjacent (stride (1, M)); rows_multiple: M padded up to one (zero codes), both as cuBLAS's
    block-scaled GEMM reads them."""
    assert x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    m_out = triton.cdiv(m, rows_multiple) * rows_multiple
    groups = triton.cdiv(k, group)
    q = torch.empty(m_out, k, dtype=FP8_DTYPE, device=x.device)
    if outer_major:
        s = torch.empty(groups, m_out, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(m_out, groups, dtype=torch.float32, device=x.device)
    strides = (x.stride(0), q.stride(0), s.stride(0), s.stride(1), SCALE_EPS)
    group_p2 = triton.next_power_of_2(group)
    if group_p2 > QUANT_ROW_MAX:
        _long_group_quant_kernel[(m_out, groups)](x, q, s, m, k, group, *strides, BLOCK=1024,
                                                  num_warps=4)
        return q, s
    # tile sizes from the layer's K and group only: a new batch size compiles nothing
    per_row = min(triton.next_power_of_2(groups), max(1, QUANT_TILE // group_p2))
    rows = max(1, QUANT_TILE // (per_row * group_p2))
    tile = rows * per_row * group_p2
    _group_quant_kernel[(triton.cdiv(m_out, rows), triton.cdiv(groups, per_row))](
        x, q, s, m, m_out, k, group, groups, *strides, ROWS=rows, GROUPS=per_row,
        GROUP_P2=group_p2, num_warps=min(8, max(1, tile // 1024)))
    return q, s
