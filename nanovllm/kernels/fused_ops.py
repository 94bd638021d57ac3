"""RMSNorm, residual add + RMSNorm and SiLU-and-mul as Triton kernels (compile in < 1 s each).

Each can write its output as per-token FP8 codes instead (TokenCodes), for a per-channel FP8
projection after it, which then skips its own quantization launch: one pass over a row
(SiLU-and-mul holds a whole row for it), the codes per_token_group_quant would give."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.linear.fp8_quant import fp8_codes, fp8_scale
from nanovllm.kernels.linear.fp8_reference import FP8_DTYPE, SCALE_EPS
from nanovllm.kernels.linear.lora import LoRAAhead, ahead_chunk_width, shrink_chunk
from nanovllm.kernels.linear.token_codes import CODES_ROW_MAX, TokenCodes
from nanovllm.kernels.pdl import launch_options, wait_then_release

_SCALE_EPS = tl.constexpr(SCALE_EPS)


@triton.jit
def _store_codes(y, q_ptr, qs_ptr, row, cols, mask, H):
    """One row's per-token FP8 codes of y (the 16-bit output) and its scale, as
    fp8_quant.per_token_group_quant computes them from that output (padded lanes of y are 0)."""
    y = y.to(tl.float32)
    scale = fp8_scale(tl.max(tl.abs(y), axis=0), _SCALE_EPS)
    q = fp8_codes(y, scale)
    tl.store(q_ptr + row * H + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(qs_ptr + row, scale)


@triton.jit
def load_row(x_ptr, res_ptr, row, cols, mask, stride_x, stride_res, stride_split, dtype,
              ADD: tl.constexpr, PARTIALS: tl.constexpr):
    """float32 x[row, cols] (+ the residual's), as the norm normalises it: split-K partials
    summed in order and rounded as the GEMM's own output would be; the sum with the residual
    not rounded."""
    if PARTIALS:
        x = tl.zeros(cols.shape, tl.float32)
        for split in tl.static_range(PARTIALS):
            x += tl.load(x_ptr + split * stride_split + row * stride_x + cols, mask=mask,
                         other=0.0)
        x = x.to(dtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def rms_scaled(x, w, eps, H, dtype: tl.constexpr):
    """(RMSNorm of the float32 row x with weight w, in dtype; its rstd), as rms_forward:
    round to the input dtype, then multiply by the weight in that dtype. For bf16/fp16 the
    float32 product of two such values is exact, so rounding it once equals their own
    multiply (for float32 the casts are no-ops). Padded lanes of x must be 0."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype), rstd


@triton.jit(do_not_specialize=["stride_split", "M"])  # tokens x hidden: changes every step
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res,
                     stride_split, eps, a_ptr, slots_ptr, ahead_ptr, rstd_ptr, q_ptr, qs_ptr,
                     M, H: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
                     CODES: tl.constexpr,
                     PARTIALS: tl.constexpr, LORA_SR: tl.constexpr, SR_PAD: tl.constexpr,
                     NUM_SLOTS: tl.constexpr, RANK: tl.constexpr, CHUNK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """Grid (N, 1 + chunks with LoRA): program 0 normalises one row; with ADD, first adds the
    residual row and stores the sum. With PARTIALS > 0, x is that many float32 split-K partial
    rows (kernels.linear.fused). With LoRA (LORA_SR > 0) program 0 also stores the row's rstd
    and each other program one chunk of the next projection's shrink
    (kernels.linear.lora.shrink_chunk). With CODES the normed row is stored as per-token FP8
    codes and their scale (q_ptr, qs_ptr), not in out_ptr's dtype."""
    wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: no overflow on long prefills
    chunk = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    if chunk == 0:
        cols = tl.arange(0, BLOCK)
        mask = cols < H  # H need not be a power of two; padded lanes load 0 and add nothing
        # The weight is loaded before the residual store: no load may pass a store the
        # compiler cannot prove apart from it, and it would then cost one more round trip.
        x = load_row(x_ptr, res_ptr, row, cols, mask, stride_x, stride_res, stride_split,
                      dtype, ADD, PARTIALS)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # add_rms_forward: the sum is rounded for the residual, normalised unrounded
            tl.store(res_out_ptr + row * H + cols, x.to(dtype), mask=mask)
        y, rstd = rms_scaled(x, w, eps, H, dtype)
        if LORA_SR:
            tl.store(rstd_ptr + row, rstd)
        if CODES:
            _store_codes(y, q_ptr, qs_ptr, row, cols, mask, H)
        else:
            tl.store(out_ptr + row * H + cols, y, mask=mask)
    elif LORA_SR:
        slot = tl.load(slots_ptr + row)
        if slot >= 0:  # a row without an adapter: the projection reads none of its chunks
            cols = (chunk - 1) * CHUNK + tl.arange(0, CHUNK)
            mask = cols < H
            x = load_row(x_ptr, res_ptr, row, cols, mask, stride_x, stride_res,
                          stride_split, dtype, ADD, PARTIALS)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            part = shrink_chunk(x, w, a_ptr, slot, cols, mask, H, LORA_SR, SR_PAD, NUM_SLOTS,
                                RANK)
            r = tl.arange(0, SR_PAD)
            tl.store(ahead_ptr + ((chunk - 1) * M + row) * LORA_SR + r, part, mask=r < LORA_SR)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Grid (N, cdiv(D, BLOCK)): silu(x[:D]) * x[D:] for one tile of one row (no reduction)."""
    wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * D + cols, _silu_mul(x_ptr, row, cols, mask, stride_x, D, dtype),
             mask=mask)


@triton.jit
def _silu_mul(x_ptr, row, cols, mask, stride_x, D, dtype: tl.constexpr):
    """silu(x[row, cols]) * x[row, D + cols] in dtype; masked lanes 0."""
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu computes in float32 and rounds; the product is then a multiply in the input dtype
    # (exact in float32 for bf16/fp16, rounded once), as in the torch path.
    silu = (a / (1.0 + tl.exp(-a))).to(dtype).to(tl.float32)
    return (silu * b).to(dtype)


@triton.jit
def _silu_and_mul_codes_kernel(x_ptr, q_ptr, qs_ptr, stride_x, D: tl.constexpr,
                               BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (N,): one whole row's silu(x[:D]) * x[D:] in x's dtype, stored as per-token codes."""
    wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    y = _silu_mul(x_ptr, row, cols, mask, stride_x, D, x_ptr.dtype.element_ty)
    _store_codes(y, q_ptr, qs_ptr, row, cols, mask, D)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [N, last dim] with unit column stride (a view when possible, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def token_codes(rows: int, cols: int, device: torch.device) -> TokenCodes:
    """Empty per-token FP8 codes [rows, cols] and scales [rows, 1], for a kernel to fill."""
    return TokenCodes(torch.empty(rows, cols, dtype=FP8_DTYPE, device=device),
                      torch.empty(rows, 1, dtype=torch.float32, device=device))


def _norm_warps(block: int, partials: int, lora: bool = False) -> int:
    """Warps of a norm program. Split-K partials: two values a thread per split up to 2,048
    columns (at most 32 warps), so that each thread's loads are few and all are in flight at
    once (docs/design.md). Otherwise, and with LoRA's shrink chunks in the launch (not
    measured that way): 4, or 8 from 4,096 columns."""
    if partials and not lora:
        return max(4, min(32, block // 64))
    return 8 if block >= 4096 else 4


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, partials: int = 0, lora: LoRAAhead | None = None,
                 codes: bool = False) -> tuple[torch.Tensor | TokenCodes, torch.Tensor | None]:
    """Shared wrapper of rms_norm and add_rms_norm: new contiguous outputs shaped like the
    residual (x, or x's rows, without one); with lora, its buffers filled too; with codes,
    the normed rows as TokenCodes."""
    like = x if residual is None else residual
    hidden = like.shape[-1]
    assert weight.shape == (hidden,) and weight.dtype == like.dtype, "weight in the input dtype"
    assert weight.is_contiguous()
    x2 = x if partials else _rows(x)
    res2 = None if residual is None else _rows(residual)
    # with codes no 16-bit normed rows are kept: the kernel then takes only like's dtype
    out = None if codes else torch.empty(like.shape, dtype=like.dtype, device=x.device)
    res_out = None if residual is None else torch.empty(like.shape, dtype=like.dtype,
                                                        device=x.device)
    num_rows = res2.shape[0] if partials else x2.shape[0]
    assert not (codes and lora), "codes feed an FP8 projection without LoRA"
    handed = token_codes(num_rows, hidden, x.device) if codes else None
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        chunks, sr, slots, rank = 0, 0, 0, 1
        if lora is not None:
            slices, slots, rank, _ = lora.lora_a.shape
            chunks, sr = lora.parts.shape[0], slices * rank
            assert lora.lora_a.is_contiguous() and lora.lora_a.shape[3] == hidden
            assert lora.parts.shape[1:] == (num_rows, sr) and lora.rstd.shape == (num_rows,)
        dst = like if out is None else out
        _rms_norm_kernel[(num_rows, 1 + chunks)](
            x2, x2 if res2 is None else res2, weight, dst, dst if res_out is None else res_out,
            x2.stride(-2), 0 if res2 is None else res2.stride(0), x2.stride(0), eps,
            *(lora or (None,) * 4), *(handed or (None, None)), num_rows, H=hidden,
            BLOCK=block, ADD=residual is not None, CODES=codes, PARTIALS=partials, LORA_SR=sr,
            SR_PAD=triton.next_power_of_2(max(sr, 1)), NUM_SLOTS=slots, RANK=rank,
            CHUNK=ahead_chunk_width(hidden), num_warps=_norm_warps(block, partials, chunks > 0),
            **launch_options())
    return (handed if codes else out), res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             lora: LoRAAhead | None = None, codes: bool = False) -> torch.Tensor | TokenCodes:
    """RMSNorm over the last dim of x (any leading shape), as RMSNorm.rms_forward; with lora,
    the next projection's shrink computed into its buffers; with codes, as TokenCodes."""
    return _launch_norm(x, None, weight, eps, lora=lora, codes=codes)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 lora: LoRAAhead | None = None, codes: bool = False
                 ) -> tuple[torch.Tensor | TokenCodes, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) as new tensors, as RMSNorm.add_rms_forward."""
    assert residual.shape == x.shape and residual.dtype == x.dtype
    return _launch_norm(x, residual, weight, eps, lora=lora, codes=codes)


def add_partials_rms_norm(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, lora: LoRAAhead | None = None, codes: bool = False
                          ) -> tuple[torch.Tensor | TokenCodes, torch.Tensor]:
    """add_rms_norm of split_k_linear's partials [S, *residual.shape], summed in order."""
    assert partials.shape[1:] == residual.shape and partials.dtype == torch.float32
    assert partials.is_contiguous() and residual.dim() == 2
    return _launch_norm(partials, residual, weight, eps, partials=partials.shape[0], lora=lora,
                        codes=codes)


def silu_and_mul_codes(x: torch.Tensor) -> TokenCodes:
    """silu_and_mul(x)'s rows [tokens, d] as per-token FP8 codes, in one pass a row (d up to
    CODES_ROW_MAX)."""
    d = x.shape[-1] // 2
    x2 = _rows(x)
    assert x.shape[-1] == 2 * d and 0 < d <= CODES_ROW_MAX
    handed = token_codes(x2.shape[0], d, x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(d)
        _silu_and_mul_codes_kernel[(x2.shape[0],)](
            x2, *handed, x2.stride(0), D=d, BLOCK=block,
            num_warps=max(4, min(32, block // 512)), **launch_options())
    return handed


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
