"""LoRA deltas for a batch of rows, each row through its own adapter slot (Punica-style):

    y[rows of slot l, slice s] += (x[rows] A_l,s^T) B_l,s^T

shrink: x [T, K] @ A [L, S*R, K]^T -> [T, S*R] (float32); expand: each slice's R columns
@ its B rows -> added to y's columns of that slice. Rows come grouped by slot (LoRAMapping), so
a program reads one adapter's weights for up to BLOCK_M rows; slots with no rows exit at once,
which keeps the grid static for CUDA graphs. Scaling is folded into B when a slot is loaded.
The torch reference is kernels.lora_torch.add_lora_torch.

    lora_a[l]  [S*R, K]   slice s's A in rows s*R .. s*R + R (rank r <= R, zero padded)
    lora_b[l]  [OUT, R]   slice s's B in rows off_s .. off_s + size_s (q | k | v, gate | up)
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_triton import dot_precision
from nanovllm.utils.context import LoRAMapping

BLOCK_M = 16


@triton.jit
def _group_rows(rows_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """(this program's rows, their mask, whether it has any) within slot's group."""
    count = tl.load(counts_ptr + slot)
    start = tl.load(starts_ptr + slot)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    rows = tl.load(rows_ptr + start + offs, mask=mask, other=0).to(tl.int64)
    return rows, mask, pid_m * BLOCK_M < count


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, rows_ptr, counts_ptr, starts_ptr, stride_x,
                   stride_al, stride_an, stride_out, N, K, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N), L): out[rows] = x[rows] @ A_l^T, one tile."""
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, mask_m, active = _group_rows(rows_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M)
    if active:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        a_base = a_ptr + slot.to(tl.int64) * stride_al
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], acc,
                 mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, rows_ptr, counts_ptr, starts_ptr, stride_s,
                   stride_bl, stride_bo, stride_y, off1, off2, off3, R: tl.constexpr,
                   BLOCK_R: tl.constexpr, SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), cdiv(largest slice, BLOCK_N), L * SLICES): y[rows, slice's
    columns] += shrunk[rows, slice's R] @ B_l[slice's rows]^T, one tile."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    slot, sl = tl.program_id(2) // SLICES, tl.program_id(2) % SLICES
    lo = tl.where(sl == 0, 0, tl.where(sl == 1, off1, off2))
    hi = tl.where(sl == 0, off1, tl.where(sl == 1, off2, off3))
    rows, mask_m, active = _group_rows(rows_ptr, counts_ptr, starts_ptr, slot, pid_m, BLOCK_M)
    if active and lo + pid_n * BLOCK_N < hi:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        cols = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_c = cols < hi
        dtype = b_ptr.dtype.element_ty
        # rounded to the model dtype, as PEFT's lora_A output is
        s = tl.load(s_ptr + rows[:, None] * stride_s + sl * R + offs_r[None, :],
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(dtype)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + cols[None, :] * stride_bo
                    + offs_r[:, None], mask=mask_c[None, :] & mask_r[:, None], other=0.0)
        delta = tl.dot(s, b, input_precision=PRECISION)
        mask = mask_m[:, None] & mask_c[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """float32 [T, S*R]: x @ A_slot^T for the grouped rows (other rows left unwritten)."""
    num_tokens, k = x.shape
    num_slots, n, _ = lora_a.shape
    out = torch.empty(num_tokens, n, dtype=torch.float32, device=x.device)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(n, block_n), num_slots)
    _shrink_kernel[grid](x, lora_a, out, mapping.rows, mapping.counts, mapping.starts,
                         x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0), n, k,
                         BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=128,
                         PRECISION=dot_precision(x.dtype))
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor,
                slice_sizes: tuple[int, ...], mapping: LoRAMapping) -> None:
    """y[grouped rows] += each slice's shrunk columns @ its B rows^T, in place."""
    assert 1 <= len(slice_sizes) <= 3 and sum(slice_sizes) == y.size(1) == lora_b.size(1)
    num_slots, _, rank = lora_b.shape
    ends = [sum(slice_sizes[:i + 1]) for i in range(len(slice_sizes))]
    ends += [ends[-1]] * (3 - len(ends))
    block_n = 64
    grid = (triton.cdiv(y.size(0), BLOCK_M), triton.cdiv(max(slice_sizes), block_n),
            num_slots * len(slice_sizes))
    _expand_kernel[grid](shrunk, lora_b, y, mapping.rows, mapping.counts, mapping.starts,
                         shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                         *ends, R=rank, BLOCK_R=max(16, triton.next_power_of_2(rank)),
                         SLICES=len(slice_sizes), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                         PRECISION=dot_precision(y.dtype))


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, slice_sizes: tuple[int, ...],
                    mapping: LoRAMapping) -> None:
    """add_lora_torch as two Triton kernels (shrink, expand); no host sync, graph-safe."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and lora_a.is_contiguous() \
        and lora_b.is_contiguous()
    lora_expand(y, lora_shrink(x, lora_a, mapping), lora_b, slice_sizes, mapping)
