"""LoRA deltas for a batch of rows, each row through its own adapter slot (-1: none):

    y[row, slice s] += (x[row] A_{slot,s}^T) B_{slot,s}^T

in two dense products over every slot at once, with no host sync (graph-safe):

    shrink: shrunk [T, S*L*R] = x @ A^T, each row keeping only its slot's columns (zeros
            elsewhere), rounded to the model dtype as PEFT's lora_A output is;
    expand: y[:, slice s] += shrunk[:, slice s's L*R columns] @ B[slice s's rows]^T.

Layouts of a projection with S fused slices (q | k | v, gate | up), L slots, rank R <= max rank
(zero padded), scaling folded into B when a slot is loaded (lora.manager):

    lora_a  [S, L, R, K]   A of slice s, slot l
    lora_b  [OUT, L, R]    B of the slice that output row belongs to, slot l

This file is the CPU path and the reference of the Triton shrink (kernels.linear.lora); the
expand is this GEMM on every backend, or one more K step inside the fused decode projections."""
import torch


def lora_shrink_torch(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor
                      ) -> torch.Tensor:
    """[T, S*L*R] in x's dtype: x @ A^T in each row's slot's columns, zeros elsewhere."""
    num_slices, num_slots, rank, k = lora_a.shape
    shrunk = x @ lora_a.view(-1, k).t()
    col_slot = torch.arange(num_slots, device=x.device).repeat_interleave(rank).repeat(num_slices)
    return shrunk * (slots[:, None] == col_slot[None, :]).to(shrunk.dtype)


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor,
                slice_sizes: tuple[int, ...]) -> torch.Tensor:
    """y[:, slice s] += shrunk's slice-s columns @ B[slice s's rows]^T, in place; returns y."""
    b = lora_b.flatten(1)  # [OUT, L*R]
    width, start = b.shape[1], 0
    for s, size in enumerate(slice_sizes):
        y[:, start:start + size].addmm_(shrunk[:, s * width:(s + 1) * width],
                                        b[start:start + size].t())
        start += size
    return y
