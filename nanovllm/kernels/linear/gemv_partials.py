"""One-token split-K partials on CUDA cores (kernels.linear.gemv's approach): o_proj and
down_proj of a lone token's decode step, as split_k_linear's partials for the add + RMSNorm
after them to sum. A program takes a slice of the weight's rows and of K; o_proj's programs
may first merge the decode attention's splits for the heads their K slice holds
(pending_merge.PendingMerge), so that the merge needs no launch of its own.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.decode_reduce import (
    MAX_SPLITS,
    MERGE_CHUNK,
    live_splits,
    merged_heads,
)
from nanovllm.kernels.attention.pending_merge import PendingMerge
from nanovllm.kernels.linear.gemv import SLICE_BYTES, dtype_ok, row_values, weight_ok
from nanovllm.kernels.linear.norm_prologue import MAX_PARTIALS
from nanovllm.kernels.pdl import launch_options, wait_then_release

ROW_BYTES = 2048  # the widest K slice of one row a partials program takes
# Heads a merging partials program merges at most (each of its splits' acc: HEAD_DIM floats):
# Qwen3-0.6B's o_proj, k-major, takes 512 K rows a program, 4 heads of 128
MERGE_HEADS = 4
K_MAJOR_ROWS = 16  # output columns of a k-major program: one 32-byte sector of each weight
# row, so a program takes 512 K rows (16-bit) and the norm after sums half the partials of 32
# A merging k-major program takes twice the columns over the same K rows: each head's splits
# are then merged by half as many programs (o_proj's 32 KB a program: docs/design.md)
MERGE_ROWS = 2 * K_MAJOR_ROWS


# Loads before the PDL wait: only weights and their scales (kernels.pdl)
@triton.jit
def _weight_slice(w_ptr, rows, ks, stride_w, K_MAJOR: tl.constexpr):
    """W[rows, ks] as stored: [ks, rows] of a k-major [K, N] weight, else [rows, ks]."""
    if K_MAJOR:
        w = tl.load(w_ptr + ks.to(tl.int64)[:, None] * stride_w + rows[None, :])
    else:
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + ks[None, :])
    return w


@triton.jit(do_not_specialize=["num_splits", "window"])
def _gemv_partials_kernel(w_ptr, x_ptr, s_ptr, part_ptr, N, stride_w, m_ptr, l_ptr, acc_ptr,
                          num_splits, ctx_ptr, window, BLOCK_N: tl.constexpr,
                          K_SPLIT: tl.constexpr, K_MAJOR: tl.constexpr, W_SCALE: tl.constexpr,
                          MERGE: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr,
                          CHUNK: tl.constexpr, KEYS_N: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (N / BLOCK_N, K / K_SPLIT): part[split, 0, rows] = x[ks] . W[rows, ks], W stored
    [K, N] when K_MAJOR (16-bit RowParallelLinear weights), else [N, K]; W_SCALE: per-channel
    FP8 scales s[rows]. MERGE: x is a decode's output left as num_splits softmax partials
    (m, l, acc), which each program merges for its K_SPLIT / HEAD_DIM heads (x_ptr: the
    output's dtype, never read): the merge needs no launch of its own. KEYS_N > 0: the
    decode's keys per tile, and which splits hold a key follows from context_lens (ctx_ptr)
    and window before the wait (decode_reduce.live_splits)."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * K_SPLIT + tl.arange(0, K_SPLIT)
    w = _weight_slice(w_ptr, rows, ks, stride_w, K_MAJOR)
    scale = row_values(s_ptr, rows, W_SCALE)
    live = live_splits(ctx_ptr, num_splits, window, KEYS_N, KEYS_N > 0)
    wait_then_release(USE_PDL)
    if MERGE:
        x = merged_heads(m_ptr, l_ptr, acc_ptr, split * (K_SPLIT // HEAD_DIM), num_splits, live,
                         x_ptr.dtype.element_ty, K_SPLIT // HEAD_DIM, HEAD_DIM, SPLITS_P2,
                         CHUNK, KEYS_N > 0)
    else:
        x = tl.load(x_ptr + ks).to(tl.float32)
    if K_MAJOR:
        y = tl.sum(w.to(tl.float32) * x[:, None], 0)
    else:
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
    if W_SCALE:
        y *= scale
    tl.store(part_ptr + split * N + rows, y)


def _partials_tiles(n: int, k: int, elem_bytes: int, k_major: bool, merge: bool = False
                    ) -> tuple[int, int] | None:
    """(BLOCK_N, K_SPLIT) filling SLICE_BYTES: for [N, K] weights the widest power-of-two K
    slice up to ROW_BYTES that divides K (few partials for the norm after to sum); k-major,
    K_MAJOR_ROWS columns (whole 32-byte sectors; MERGE_ROWS for a merge) of the widest K slice
    up to SLICE_BYTES / K_MAJOR_ROWS that divides K. None when they do not divide the weight."""
    k_split = SLICE_BYTES // (K_MAJOR_ROWS * elem_bytes) if k_major else ROW_BYTES // elem_bytes
    while k % k_split and k_split > 16:
        k_split //= 2
    block_n = ((MERGE_ROWS if merge else K_MAJOR_ROWS) if k_major
               else SLICE_BYTES // (k_split * elem_bytes))
    if k % k_split or block_n > 64 or n % block_n or k // k_split > MAX_PARTIALS:
        return None
    return block_n, k_split


def _stored_tiles(weight: torch.Tensor, merge: bool = False) -> tuple[int, int] | None:
    """_partials_tiles of a weight stored [N, K], or k-major (weight.t() contiguous)."""
    n, k = weight.shape
    k_major = not weight.is_contiguous()
    if k_major and not weight.t().is_contiguous():
        return None
    return _partials_tiles(n, k, weight.element_size(), k_major, merge)


def runs_gemv(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None = None,
              w_block=None) -> bool:
    """Whether gemv_partials takes this step: one token, and tiles that fit the weight (stored
    [N, K], or k-major with weight.t() contiguous)."""
    return weight_ok(x, weight, w_scale, w_block) and _stored_tiles(weight) is not None


def runs_merge_gemv(x_dtype: torch.dtype, head_dim: int, weight: torch.Tensor,
                    w_scale: torch.Tensor | None = None, w_block=None) -> bool:
    """Whether gemv_partials takes a PendingMerge of x_dtype heads of head_dim: a weight
    runs_gemv takes, each program's K slice whole heads, at most MERGE_HEADS."""
    tiles = _stored_tiles(weight, True) if dtype_ok(x_dtype, weight, w_scale, w_block) else None
    return tiles is not None and tiles[1] % head_dim == 0 \
        and tiles[1] // head_dim <= MERGE_HEADS


def gemv_partials(x: torch.Tensor | PendingMerge, weight: torch.Tensor,
                  w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 partials [S, 1, N] whose sum over S is x @ weight.T (split_k_linear's contract)
    for one token; weight [N, K] as runs_gemv takes it, FP8 codes with per-channel w_scale. x
    may be a PendingMerge (as runs_merge_gemv takes it), merged inside."""
    n, k = weight.shape
    k_major = not weight.is_contiguous()
    stored = weight.t() if k_major else weight
    merge = x if isinstance(x, PendingMerge) else None
    block_n, k_split = _partials_tiles(n, k, weight.element_size(), k_major, merge is not None)
    if merge is not None:
        x = merge.out
    assert x.shape[0] == 1, "one token's partials (a PendingMerge too)"
    part = torch.empty(k // k_split, 1, n, dtype=torch.float32, device=x.device)
    _gemv_partials_kernel[(n // block_n, k // k_split)](
        stored, x, weight if w_scale is None else w_scale, part, n, stored.stride(0),
        **_merge_args(merge, x), BLOCK_N=block_n, K_SPLIT=k_split, K_MAJOR=k_major,
        W_SCALE=w_scale is not None, MERGE=merge is not None,
        HEAD_DIM=x.shape[-1] if merge is not None else 1, SPLITS_P2=MAX_SPLITS,
        CHUNK=MERGE_CHUNK, num_warps=4, **launch_options())
    return part


def _merge_args(merge: PendingMerge | None, x: torch.Tensor) -> dict:
    """_gemv_partials_kernel's arguments of a PendingMerge (none: x as placeholders, never
    read)."""
    if merge is None:
        return dict(m_ptr=x, l_ptr=x, acc_ptr=x, num_splits=1, ctx_ptr=x, window=0, KEYS_N=0)
    known = merge.context_lens is not None
    return dict(m_ptr=merge.part_m, l_ptr=merge.part_l, acc_ptr=merge.part_acc,
                num_splits=merge.part_acc.shape[2],
                ctx_ptr=merge.context_lens if known else merge.part_m, window=merge.window,
                KEYS_N=merge.block_n if known else 0)
