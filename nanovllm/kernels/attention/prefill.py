"""Triton paged attention: flash-attention prefill, and what decode shares with it
(decode.py holds the split-KV decode).

Paged reads take an FP8 cache too: its rows widen exactly to the query dtype for tl.dot, and
the layer's scales are folded in, k_scale into the softmax scale and v_scale into the output.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.reference import check_sliding_window

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) == exp2(x * log2(e))


@triton.jit
def _locate_tile(cu_q_ptr, num_seqs, BLOCK_M: tl.constexpr, SEQS_CHUNK: tl.constexpr):
    """Map program_id(0) to (sequence, first query of its tile); seq >= num_seqs if surplus."""
    tile = tl.program_id(0)
    # Tiles are numbered sequence after sequence: the sequences whose tiles all come before
    # this one give its sequence index (their count) and its first tile (their tile sum).
    # SEQS_CHUNK sequences at a time: one compiled variant serves every batch size. Entries
    # past num_seqs have no tiles, so a surplus program counts them all (seq >= num_seqs).
    seq = 0
    first = 0
    done = 0  # tiles of the chunks before this one
    for base in range(0, num_seqs, SEQS_CHUNK):
        seqs = base + tl.arange(0, SEQS_CHUNK)
        valid = seqs < num_seqs
        starts = tl.load(cu_q_ptr + seqs, mask=valid, other=0)
        ends = tl.load(cu_q_ptr + seqs + 1, mask=valid, other=0)
        num_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        before = done + tl.cumsum(num_tiles, axis=0) <= tile
        seq += tl.sum(before.to(tl.int32), axis=0)
        first += tl.sum(tl.where(before, num_tiles, 0), axis=0)
        done += tl.sum(num_tiles, axis=0)
    return seq, (tile - first) * BLOCK_M


@triton.jit
def softmax_step(q, k_t, v, visible, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr,
                 MAY_BE_HIDDEN: tl.constexpr = False, MASKED: tl.constexpr = True):
    """One online-softmax update of (m_i, l_i, acc) with a key tile k_t [D, N], v [N, D]; without
    MASKED every key is visible to every row (`visible` is ignored)."""
    qk = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # Causal, the first tile shows key 0 to every row; with a window a row may have seen nothing
    # yet (m_new = -inf): shifting by 0 keeps its l_i, acc at 0 instead of NaN (-inf - -inf).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new) if MAY_BE_HIDDEN else m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(qk - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tiles(q, k_ptr, v_ptr, block_tables_ptr, seq, k_start, len_k, q_pos, lo, kv_head,
                  m_i, l_i, acc, qk_scale, window, stride_kn, stride_kh, stride_vn, stride_vh,
                  stride_bt, start, end, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr,
                  SLIDING: tl.constexpr, MASKED: tl.constexpr):
    """Online softmax over the key tiles start..end of one query tile; without MASKED each tile
    is whole, inside the sequence and visible to every query row."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        # Key tiles never cross a page (BLOCK_N divides BLOCK_SIZE): one table lookup per tile.
        if PAGED:
            block_id = tl.load(block_tables_ptr + seq * stride_bt + start_n // BLOCK_SIZE)
            rows = block_id.to(tl.int64) * BLOCK_SIZE + start_n % BLOCK_SIZE + offs_n
        else:
            rows = (k_start + start_n + offs_n).to(tl.int64)
        k_offs = rows[None, :] * stride_kn + kv_head * stride_kh + offs_d[:, None]
        v_offs = rows[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :]
        if MASKED:
            k_pos = start_n + offs_n
            in_seq = k_pos < len_k
            if SLIDING:
                in_seq &= k_pos >= lo
            k_t = tl.load(k_ptr + k_offs, mask=in_seq[None, :], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + v_offs, mask=in_seq[:, None], other=0.0).to(q.dtype)
            visible = (k_pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
            if SLIDING:
                visible &= q_pos[:, None] - k_pos[None, :] < window
        else:
            k_t = tl.load(k_ptr + k_offs).to(q.dtype)
            v = tl.load(v_ptr + v_offs).to(q.dtype)
            visible = None
        m_i, l_i, acc = softmax_step(q, k_t, v, visible, m_i, l_i, acc, qk_scale, PRECISION,
                                     SLIDING, MASKED)
    return m_i, l_i, acc


# num_seqs and stride_bt (the widest block table) change every step: specialising on their
# values (1, multiple of 16) would compile new variants mid-run; window likewise stays a plain
# int (SLIDING alone picks the variant).
@triton.jit(do_not_specialize=["stride_bt", "num_seqs", "window"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr, block_tables_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_bt, qk_scale, v_scale, num_seqs, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQS_CHUNK: tl.constexpr, PAGED: tl.constexpr,
    PRECISION: tl.constexpr, SLIDING: tl.constexpr,
):
    """Grid (query tiles, H): causal attention of one [BLOCK_M, D] query tile of one head."""
    head = tl.program_id(1)
    seq, m_start = _locate_tile(cu_q_ptr, num_seqs, BLOCK_M, SEQS_CHUNK)
    if seq >= num_seqs:  # surplus program of the upper-bound grid
        return
    q_start = tl.load(cu_q_ptr + seq)
    len_q = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq)
    len_k = tl.load(cu_k_ptr + seq + 1) - k_start
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + offs_m).to(tl.int64)
    q_mask = (offs_m < len_q)[:, None]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    q_pos = len_k - len_q + offs_m  # a cached prefix of len_k - len_q tokens precedes the queries
    kv_head = head // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal: key tiles past the tile's last query position are skipped entirely. With a window,
    # keys before lo (the first query's window start) are hidden from the whole tile: whole
    # tiles of them are skipped, the rest masked at load, so they are never read.
    kv_end = tl.minimum(len_k, len_k - len_q + m_start + BLOCK_M)
    lo = 0
    if SLIDING:
        lo = tl.maximum(len_k - len_q + m_start - window + 1, 0)
    first = lo // BLOCK_N * BLOCK_N
    # Tiles every row of the query tile sees whole (no window) skip the masks: only the 1-2
    # tiles on the diagonal, and the sequence's last, pay for them.
    full_end = first
    if not SLIDING:
        full_end = tl.minimum((len_k - len_q + m_start + 1) // BLOCK_N * BLOCK_N, kv_end)
    m_i, l_i, acc = _attend_tiles(
        q, k_ptr, v_ptr, block_tables_ptr, seq, k_start, len_k, q_pos, lo, kv_head, m_i, l_i,
        acc, qk_scale, window, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, first,
        full_end, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED, PRECISION, SLIDING, False)
    m_i, l_i, acc = _attend_tiles(
        q, k_ptr, v_ptr, block_tables_ptr, seq, k_start, len_k, q_pos, lo, kv_head, m_i, l_i,
        acc, qk_scale, window, stride_kn, stride_kh, stride_vn, stride_vh, stride_bt, full_end,
        kv_end, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED, PRECISION, SLIDING, True)
    if SLIDING:  # padding rows past len_q may see no key at all: keep them finite
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None] * v_scale
    o_ptrs = out_ptr + q_rows[:, None] * stride_on + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


_LONG_PROMPT = 8192  # queries in one sequence from which the larger prefill tiles are used


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: IEEE for float32 (Triton's default, TF32, keeps 10 mantissa
    bits: a float32 run would differ from the torch reference at near-ties); native otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _prefill_config(head_dim: int, block_size: int, elem_size: int,
                    max_seqlen_q: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N divides block_size (no page crossing).
    Long prompts in 16-bit take 128 x 128 tiles, which win from 8k queries on and lose on short
    prompts (measured in docs/design.md)."""
    if (max_seqlen_q is not None and max_seqlen_q >= _LONG_PROMPT and head_dim <= 128
            and elem_size == 2 and block_size % 128 == 0):
        return 128, 128, 8, 3
    block_n = min(64 if head_dim <= 128 else 32, block_size)
    num_warps = 4 if head_dim <= 128 else 8
    num_stages = 2 if elem_size > 2 or head_dim > 128 else 3  # bound shared memory
    return 64, block_n, num_warps, num_stages


def prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor | None,
    scale: float,
    max_seqlen_q: int | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal varlen flash attention; keys from dense k/v, or the paged cache via block_tables
    (an FP8 cache dequantized with k_scale, v_scale)."""
    window = check_sliding_window(sliding_window)
    num_q, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.numel() - 1
    out = torch.empty((num_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_q == 0 or num_seqs == 0:
        return out
    paged = block_tables is not None
    keys, values = (k_cache, v_cache) if paged else (k, v)
    block_size = k_cache.shape[1] if paged else 256  # dense: any tile width divides it
    check_shapes(q, keys, values, block_size, paged)
    block_m, block_n, warps, stages = _prefill_config(head_dim, block_size, q.element_size(),
                                                      max_seqlen_q)
    # Grid sized without a host sync: an upper bound on the query tiles of all sequences; the
    # kernel maps each program to its (sequence, tile) and surplus programs exit at once.
    num_tiles = triton.cdiv(num_q, block_m) + num_seqs
    if max_seqlen_q is not None:
        num_tiles = min(num_tiles, num_seqs * triton.cdiv(max_seqlen_q, block_m))
    if paged:  # the cache is addressed as [num_slots, Hkv, D]
        strides = (keys.stride(1), keys.stride(2), values.stride(1), values.stride(2))
    else:  # this step's own k/v, never quantized
        strides = (keys.stride(0), keys.stride(1), values.stride(0), values.stride(1))
        k_scale = v_scale = 1.0
    _prefill_kernel[(num_tiles, num_heads)](
        q, keys, values, out, cu_seqlens_q, cu_seqlens_k,
        block_tables if paged else cu_seqlens_q,  # dummy pointer in dense mode
        q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1),
        block_tables.stride(0) if paged else 0, scale * LOG2E * k_scale, v_scale, num_seqs,
        window,
        GROUP=num_heads // keys.shape[-2], HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged, PRECISION=dot_precision(q.dtype),
        SLIDING=window > 0, SEQS_CHUNK=64,
        num_warps=warps, num_stages=stages,
    )
    return out


def check_shapes(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_size: int, paged: bool
) -> None:
    """Assert the layout assumptions shared by both kernels."""
    head_dim = q.shape[-1]
    assert head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256, "head_dim: pow2 in 16..256"
    assert block_size & (block_size - 1) == 0 and block_size >= 16, "block_size: pow2 >= 16"
    assert q.shape[-2] % keys.shape[-2] == 0, "num_heads must be a multiple of num_kv_heads"
    assert keys.shape[-1] == head_dim and values.shape == keys.shape
    assert q.stride(-1) == 1 and keys.stride(-1) == 1 and values.stride(-1) == 1
    if paged:
        assert keys.is_contiguous() and values.is_contiguous(), "KV cache must be contiguous"

