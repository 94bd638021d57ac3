"""W8A8 GEMM of FP8 codes with the operands swapped: the weight's rows fill the MMA's M side,
the tokens its N side, so that every program reads a distinct slab of the weight by TMA and the
tokens' codes, shared by all programs, come from L2. Splitting K gives o_proj/down_proj's few
thousand rows enough programs for every SM; split partials are float32, summed by
split_k.sum_partials. fp8_gemm.fp8_linear picks it (for how many tokens, see there). Not a PDL
launch: with PDL it and the quantization before it were slower (docs/experiments.md)."""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.linear.fused_fp8 import num_sms
from nanovllm.kernels.linear.split_k import sum_partials


@triton.jit(do_not_specialize=["M"])
def _w8a8_swap_kernel(w_desc, x_desc, out_ptr, ws_ptr, xs_ptr, bias_ptr, M, N, K_SPLIT,
                      stride_ws, stride_xs, scale_rows, BLOCK_W: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                      PER_BLOCK: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Grid (N / BLOCK_W, splits, token tiles): acc [BLOCK_W, BLOCK_T] = W[rows, ks] . x[toks,
    ks]^T scaled per channel and token (after the loop) or per 128x128 block and token group
    (each K step); written transposed into out [M, N], or as split's float32 partial."""
    pid_w, split, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n0, tok0 = pid_w * BLOCK_W, pid_t * BLOCK_T
    rows = n0 + tl.arange(0, BLOCK_W)
    toks = tok0 + tl.arange(0, BLOCK_T)
    t_mask = toks < M
    acc = tl.zeros([BLOCK_W, BLOCK_T], tl.float32)
    k0 = split * K_SPLIT
    for k in tl.range(k0, k0 + K_SPLIT, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k])
        x = x_desc.load([tok0, k])
        # each step's product joins the float32 accumulator on its own: sm_90's FP8 MMA
        # accumulates at reduced precision, which over all of K lost 5e-4 of the output
        step = tl.dot(w, x.T)
        if PER_BLOCK:
            w_s = tl.load(ws_ptr + rows // scale_rows * stride_ws + k // BLOCK_K)
            x_s = tl.load(xs_ptr + toks * stride_xs + k // BLOCK_K, mask=t_mask, other=0.0)
            acc += step * w_s[:, None] * x_s[None, :]
        else:
            acc += step
    if not PER_BLOCK:
        w_s = tl.load(ws_ptr + rows)
        x_s = tl.load(xs_ptr + toks * stride_xs, mask=t_mask, other=0.0)
        acc = acc * w_s[:, None] * x_s[None, :]
    ptrs = toks[None, :].to(tl.int64) * N + rows[:, None]
    if PARTIAL:
        tl.store(out_ptr + split.to(tl.int64) * M * N + ptrs, acc, mask=t_mask[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows).to(tl.float32)[:, None]
        tl.store(out_ptr + ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_mask[None, :])


def fits_w8a8_swap(n: int, k: int, block: tuple[int, int] | None) -> bool:
    """Whether w8a8_swap takes a weight [n, k]: whole 128-row tiles and 128-wide K steps, and
    block scales (if any) of 128 x 128."""
    return n % 128 == 0 and k % 128 == 0 and (block is None or tuple(block) == (128, 128))


def swap_config(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_W, BLOCK_T, splits, stages, warps) for m tokens, the H200 sweep's rule
    (docs/quantization.md): token tiles of up to 128; 128-row weight tiles where 64-row ones
    would give over two programs a SM; K halved while that keeps at most two programs a SM
    and each split at least 2,048 columns."""
    block_t = max(16, min(128, triton.next_power_of_2(m)))
    tiles = triton.cdiv(m, block_t)
    most = 2 * sms
    block_w = 128 if n // 64 * tiles > most else 64
    programs = n // block_w * tiles
    splits = 1
    while programs * splits * 2 <= most and k % (splits * 2 * 128) == 0 \
            and k // (splits * 2) >= 2048:
        splits *= 2
    wide = block_w * block_t >= 128 * 128
    return block_w, block_t, splits, 3 if wide else 4, 8 if wide else 4


def w8a8_swap(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
              weight_scale: torch.Tensor, block: tuple[int, int] | None,
              bias: torch.Tensor | None, out_dtype: torch.dtype,
              config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """codes [M, K] (per-token or per-128-group scales) times FP8 weight [N, K] -> [M, N]."""
    m, k = codes.shape
    n = weight.shape[0]
    block_w, block_t, splits, stages, warps = config or swap_config(m, n, k, num_sms(codes.device))
    assert m > 0 and fits_w8a8_swap(n, k, block) and k % (splits * 128) == 0, (m, n, k, splits)
    assert codes.is_contiguous() and weight.is_contiguous() and scales.stride(1) == 1
    assert weight_scale.is_contiguous() and weight_scale.shape == (
        (n // 128, k // 128) if block is not None else (n, 1)), weight_scale.shape
    if splits > 1:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=codes.device)
    else:
        out = torch.empty(m, n, dtype=out_dtype, device=codes.device)
    ws_stride = weight_scale.stride(0) if block is not None else 1
    grid = (n // block_w, splits, triton.cdiv(m, block_t))
    _w8a8_swap_kernel[grid](
        TensorDescriptor.from_tensor(weight, [block_w, 128]),
        TensorDescriptor.from_tensor(codes, [block_t, 128]), out, weight_scale, scales,
        bias if bias is not None else out, m, n, k // splits, ws_stride, scales.stride(0),
        block[0] if block is not None else 1, BLOCK_W=block_w, BLOCK_T=block_t, BLOCK_K=128,
        STAGES=stages, PER_BLOCK=block is not None, PARTIAL=splits > 1,
        HAS_BIAS=bias is not None, num_warps=warps)
    return sum_partials(out, out_dtype, bias) if splits > 1 else out
