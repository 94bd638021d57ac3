"""The LoRA shrink for a batch of rows, each row through its own adapter slot, as one Triton
kernel (the torch reference and the layouts: kernels.lora_torch).

Every adapter slot's A is multiplied in, and each row keeps the columns of its own slot (others
are zeros): for max_loras x max_rank of a few dozen columns that costs less than grouping rows
by slot, and it leaves one dense product for the expand, which the fused decode projections run
as one more K step (kernels.fused_linear) and the other steps as a GEMM.

A program owns BLOCK_N columns of BLOCK_T rows; when none of its rows runs through the slots of
its columns it writes zeros without reading A (a prefill of base-model rows reads nothing).
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_triton import dot_precision


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, T, K, N, stride_x, stride_out,
                   RANK: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T), cdiv(N, BLOCK_N)): out[t, c] = x[t] . A[c] if row t's slot is
    column c's slot ((c // RANK) % NUM_SLOTS), else 0; rounded to out's dtype."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_t, mask_n = offs_t < T, offs_n < N
    slot = tl.load(slots_ptr + offs_t, mask=mask_t, other=-1)
    keep = (slot[:, None] == (offs_n // RANK % NUM_SLOTS)[None, :]) & mask_n[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    if tl.max(keep.to(tl.int32)) > 0:
        rows = offs_t.to(tl.int64)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                        mask=mask_t[:, None] & mask_k[None, :], other=0.0)
            a = tl.load(a_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(x, a, acc, input_precision=PRECISION)
    acc = tl.where(keep, acc, 0.0)
    out = out_ptr + offs_t[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_n[None, :])


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, S*L*R] in x's dtype: each row's x @ A^T in its slot's columns, zeros elsewhere, for
    lora_a [S, L, R, K]; as kernels.lora_torch.lora_shrink_torch, graph-safe (no host sync)."""
    num_tokens, k = x.shape
    num_slices, num_slots, rank, _ = lora_a.shape
    assert x.stride(1) == 1 and lora_a.is_contiguous() and lora_a.shape[3] == k
    n = num_slices * num_slots * rank
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    block_t = 16 if num_tokens <= 16 else 64
    # decode: narrow column tiles, so a row's slot reads only its own A rows
    block_n = 16 if num_tokens <= 16 else 64
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(n, block_n))
    _shrink_kernel[grid](x, lora_a, slots, out, num_tokens, k, n, x.stride(0), out.stride(0),
                         RANK=rank, NUM_SLOTS=num_slots, BLOCK_T=block_t, BLOCK_N=block_n,
                         BLOCK_K=128, PRECISION=dot_precision(x.dtype))
    return out
