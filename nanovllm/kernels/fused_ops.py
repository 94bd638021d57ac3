"""RMSNorm, residual add + RMSNorm and SiLU-and-mul as Triton kernels (compile in < 1 s each)."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import launch_options, wait_then_release


@triton.jit(do_not_specialize=["stride_split"])  # tokens x hidden: changes every step
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res,
                     stride_split, eps, H: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
                     PARTIALS: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (N,): normalise one row; with ADD, first add the residual row and store the sum.
    With PARTIALS > 0, x is that many float32 split-K partial rows (kernels.linear.fused),
    summed in order and rounded as the GEMM's own output would be."""
    wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: no overflow on long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < H  # H need not be a power of two; padded lanes load 0 and add nothing
    dtype = out_ptr.dtype.element_ty
    if PARTIALS:
        x = tl.zeros([BLOCK], tl.float32)
        for split in tl.static_range(PARTIALS):
            x += tl.load(x_ptr + split * stride_split + row * stride_x + cols, mask=mask,
                         other=0.0)
        x = x.to(dtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # Loaded before the residual store: no load may pass a store the compiler cannot prove
    # apart from it, and the weight would then cost one more memory round trip.
    w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
    if ADD:
        # add_rms_forward: the float32 sum is rounded for the residual but normalised unrounded.
        x += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * H + cols, x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    # As rms_forward: round to the input dtype, then multiply by the weight in that dtype. For
    # bf16/fp16 the float32 product of two such values is exact, so rounding it once equals
    # their own multiply (for float32 the casts are no-ops).
    y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * H + cols, y.to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Grid (N, cdiv(D, BLOCK)): silu(x[:D]) * x[D:] for one tile of one row (no reduction)."""
    wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    dtype = out_ptr.dtype.element_ty
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + D + cols, mask=mask).to(tl.float32)
    # F.silu computes in float32 and rounds; the product is then a multiply in the input dtype
    # (exact in float32 for bf16/fp16, rounded once), as in the torch path.
    silu = (a / (1.0 + tl.exp(-a))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (silu * b).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [N, last dim] with unit column stride (a view when possible, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, partials: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared wrapper of rms_norm and add_rms_norm: new contiguous outputs shaped like the
    residual (x, or x's rows, without one)."""
    like = x if residual is None else residual
    hidden = like.shape[-1]
    assert weight.shape == (hidden,) and weight.dtype == like.dtype, "weight in the input dtype"
    assert weight.is_contiguous()
    x2 = x if partials else _rows(x)
    res2 = None if residual is None else _rows(residual)
    out = torch.empty(like.shape, dtype=like.dtype, device=x.device)
    res_out = None if residual is None else torch.empty_like(out)
    num_rows = res2.shape[0] if partials else x2.shape[0]
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x2, x2 if res2 is None else res2, weight, out, out if res_out is None else res_out,
            x2.stride(-2), 0 if res2 is None else res2.stride(0), x2.stride(0), eps,
            H=hidden, BLOCK=block, ADD=residual is not None, PARTIALS=partials,
            num_warps=8 if block >= 4096 else 4, **launch_options())
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape), as RMSNorm.rms_forward."""
    return _launch_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) as new tensors, as RMSNorm.add_rms_forward."""
    assert residual.shape == x.shape and residual.dtype == x.dtype
    return _launch_norm(x, residual, weight, eps)


def add_partials_rms_norm(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm of split_k_linear's partials [S, *residual.shape], summed in order."""
    assert partials.shape[1:] == residual.shape and partials.dtype == torch.float32
    assert partials.is_contiguous() and residual.dim() == 2
    return _launch_norm(partials, residual, weight, eps, partials=partials.shape[0])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> silu(x[..., :d]) * x[..., d:] as a new contiguous [..., d], as SiluAndMul."""
    d = x.shape[-1] // 2
    assert x.shape[-1] == 2 * d
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and d > 0:
        block = min(triton.next_power_of_2(d), 1024)  # tiles: wide rows (d = 25,600) fit too
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), D=d, BLOCK=block, **launch_options())
    return out
