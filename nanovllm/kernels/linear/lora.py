"""LoRA on the GPU, each row through its own adapter slot (the torch reference and the
layouts: kernels.linear.lora_reference). Every slot's A is multiplied in and each row keeps its
own slot's columns (the others are zeros): for max_loras x max_rank of a few dozen columns that
costs less than grouping rows by slot, and it leaves dense products.

- Decode steps that run the fused projections (kernels.linear.fused) carry LoRA inside them:
  the shrink is 64 more MMA rows in their K loop (every slot's A rows of the slice), and
  add_lora masks it by slot and adds B @ it to the accumulator. No launch of its own.
- Up to AHEAD_MAX_TOKENS, qkv_proj's and gate_up_proj's shrink is computed ahead by the
  RMSNorm before them (kernels.fused_ops): programs beside the norm's each take a chunk of the
  hidden size (ahead_chunk_width) and only their row's slot's A rows (shrink_chunk), and the
  projection sums the chunks (ahead_shrunk). Its K loop then streams the weights alone: at
  one token on the H200 the in-loop shrink cost qkv_proj 1.8 us and gate_up_proj 3.4 us a
  launch (docs/lora.md).
- Other steps: lora_shrink below, then the expand as one GEMM per slice (lora_reference).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.attention.prefill import dot_precision
from nanovllm.kernels.pdl import launch_options, wait_then_release


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, T, K, N, stride_x, stride_out,
                   RANK: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                   PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T), cdiv(N, BLOCK_N)): out[t, c] = x[t] . A[c] if row t's slot is
    column c's slot ((c // RANK) % NUM_SLOTS), else 0; rounded to out's dtype."""
    wait_then_release(USE_PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_t, mask_n = offs_t < T, offs_n < N
    slot = tl.load(slots_ptr + offs_t, mask=mask_t, other=-1)
    keep = (slot[:, None] == (offs_n // RANK % NUM_SLOTS)[None, :]) & mask_n[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    if tl.max(keep.to(tl.int32)) > 0:
        x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_x
        a_rows = a_ptr + offs_n[:, None].to(tl.int64) * K
        # pipelined: a decode step's one active program streams its slot's A rows alone
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)[None, :]
            x = tl.load(x_rows + offs_k, mask=mask_t[:, None] & (offs_k < K), other=0.0)
            a = tl.load(a_rows + offs_k, mask=mask_n[:, None] & (offs_k < K), other=0.0)
            acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
    acc = tl.where(keep, acc, 0.0)
    out = out_ptr + offs_t[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_n[None, :])


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, S*L*R] in x's dtype: each row's x @ A^T in its slot's columns, zeros elsewhere, for
    lora_a [S, L, R, K]; as kernels.linear.lora_reference.lora_shrink_torch, graph-safe (no
    host sync)."""
    num_tokens, k = x.shape
    num_slices, num_slots, rank, _ = lora_a.shape
    assert x.stride(1) == 1 and lora_a.is_contiguous() and lora_a.shape[3] == k
    n = num_slices * num_slots * rank
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    # Up to a few hundred rows, small tiles: the programs a slot's columns have stream its A
    # rows, and only a few dozen columns exist; then long K steps keep their loops short
    block_t, block_n, block_k = (16, 16, 256) if num_tokens <= 512 else (64, 64, 64)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(n, block_n))
    _shrink_kernel[grid](x, lora_a, slots, out, num_tokens, k, n, x.stride(0), out.stride(0),
                         RANK=rank, NUM_SLOTS=num_slots, BLOCK_T=block_t, BLOCK_N=block_n,
                         BLOCK_K=block_k, STAGES=3, PRECISION=dot_precision(x.dtype),
                         **launch_options())
    return out


AHEAD_MAX_TOKENS = 16  # beyond, every row's A reads in the norm outgrow the in-loop shrink's


class LoRASlots(NamedTuple):
    """A layer's slots and a step's rows, for the fused decode projections."""

    lora_a: torch.Tensor  # [S, L, R, K]
    lora_b: torch.Tensor  # [OUT, L, R]
    slots: torch.Tensor  # [T] int32, -1: no adapter


class LoRAAhead(NamedTuple):
    """A projection's shrink computed ahead by the RMSNorm before it (shrink_chunk)."""

    lora_a: torch.Tensor  # [S, L, R, K] the projection's A
    slots: torch.Tensor  # [T] int32, -1: no adapter
    parts: torch.Tensor  # [chunks, T, S*R] float32: A of the row's slot @ (h * w), per chunk
    rstd: torch.Tensor  # [T] float32: the norm's 1 / rms(h)


def ahead_chunk_width(hidden_size: int) -> int:
    """Columns of the hidden size each of the norm's shrink programs takes: 128, or as many as
    make 8 chunks (more, and the projection's sum of them spills registers on sm_90)."""
    return max(128, triton.next_power_of_2(triton.cdiv(hidden_size, 8)))


def lora_ahead_buffers(lora_a: torch.Tensor, slots: torch.Tensor) -> LoRAAhead:
    """Empty LoRAAhead buffers for a step of len(slots) rows."""
    num_slices, _, rank, hidden = lora_a.shape
    num_tokens, device = slots.shape[0], lora_a.device
    chunks = triton.cdiv(hidden, ahead_chunk_width(hidden))
    parts = torch.empty(chunks, num_tokens, num_slices * rank, dtype=torch.float32,
                        device=device)
    return LoRAAhead(lora_a, slots, parts, torch.empty(num_tokens, dtype=torch.float32,
                                                       device=device))


def ahead_args(ahead: LoRAAhead | None) -> dict:
    """A fused projection kernel's arguments for a shrink computed ahead (ahead_shrunk's)."""
    if ahead is None:
        return dict(ahead_ptr=None, rstd_ptr=None, AHEAD=0, AHEAD_SR=0)
    chunks, _, slices_x_rank = ahead.parts.shape
    return dict(ahead_ptr=ahead.parts, rstd_ptr=ahead.rstd, AHEAD=chunks,
                AHEAD_SR=slices_x_rank)


def fits_lora(max_loras: int, max_rank: int) -> bool:
    """Whether the fused decode projections take these slots: every slot's rank columns in one
    64-row MMA tile, B's rows 16-byte aligned (TMA)."""
    return max_loras * max_rank <= 64 and max_loras * max_rank % 8 == 0


def fused_lora_args(lora: LoRASlots | None, block_k: int) -> dict:
    """A fused projection kernel's LoRA arguments (add_lora's): TMA descriptors of A's rows
    [S*L*R, K] in the kernel's K steps and of B [OUT, L*R], the slots, L*R and R."""
    if lora is None:
        return dict(a_desc=None, b_desc=None, lora_slots_ptr=None, LORA_K=0, RANK=1)
    a, b, slots = lora
    _, num_slots, rank, k = a.shape
    assert fits_lora(num_slots, rank) and a.is_contiguous() and b.is_contiguous()
    return dict(a_desc=TensorDescriptor.from_tensor(a.view(-1, k), [64, block_k]),
                b_desc=TensorDescriptor.from_tensor(b.view(b.shape[0], -1), [64, 64]),
                lora_slots_ptr=slots, LORA_K=num_slots * rank, RANK=rank)


@triton.jit
def lora_keep(slots_ptr, tok0, M, LORA_K: tl.constexpr, RANK: tl.constexpr,
              BLOCK_T: tl.constexpr):
    """[64, BLOCK_T]: whether shrink row r (each slot's RANK rows in turn; none past LORA_K)
    belongs to token tok0 + t's slot."""
    toks = tok0 + tl.arange(0, BLOCK_T)
    slot = tl.load(slots_ptr + toks, mask=toks < M, other=-1)
    r = tl.arange(0, 64)
    return (r < LORA_K)[:, None] & ((r // RANK)[:, None] == slot[None, :])


@triton.jit
def add_lora(acc, s, b, keep):
    """acc [64, T] + b @ s', s' the shrink s [64, T] with only the rows `keep` says (each
    token's slot), rounded to b's dtype as PEFT's lora_A output is; b: B's [64, 64] tile of
    the accumulator's rows (every slot's rank columns, zeros past LORA_K)."""
    return tl.dot(b, tl.where(keep, s, 0.0).to(b.dtype), acc)


@triton.jit
def shrink_chunk(h, w, a_ptr, slot, cols, mask, H: tl.constexpr, SR: tl.constexpr,
                 SR_PAD: tl.constexpr, NUM_SLOTS: tl.constexpr, RANK: tl.constexpr):
    """[SR_PAD] float32: (h * w)[cols] @ A[s, slot, r, cols] for each slice s and rank r in
    turn (SR = slices x RANK, padded to a power of two), h the norm's float32 row chunk and w
    its weight."""
    r = tl.arange(0, SR_PAD)
    a_rows = ((r // RANK) * NUM_SLOTS + slot) * RANK + r % RANK  # A as [S*L*R, H]
    a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * H + cols[None, :],
                mask=(r < SR)[:, None] & mask[None, :], other=0.0)
    return tl.sum(a.to(tl.float32) * (h * w)[None, :], axis=1)


@triton.jit
def ahead_shrunk(ahead_ptr, rstd_ptr, keep, tok0, M, lora_slice, SR: tl.constexpr,
                 RANK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr):
    """[64, BLOCK_T] as the in-loop shrink of slice lora_slice, in `keep`'s rows (zeros
    elsewhere): the norm's chunks summed, times each token's rstd."""
    toks = tok0 + tl.arange(0, BLOCK_T)
    col = lora_slice * RANK + tl.arange(0, 64) % RANK
    ptrs = ahead_ptr + toks[None, :].to(tl.int64) * SR + col[:, None]
    s = tl.zeros([64, BLOCK_T], tl.float32)
    for chunk in tl.static_range(CHUNKS):
        s += tl.load(ptrs + chunk * M * SR, mask=keep, other=0.0)
    rstd = tl.load(rstd_ptr + toks, mask=toks < M, other=0.0)
    return s * rstd[None, :]
