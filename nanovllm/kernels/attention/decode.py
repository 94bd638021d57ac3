"""Triton split-KV (flash-decoding) decode over the paged cache: each (sequence, KV head, split)
program attends its slice of the context for the query heads of that KV head, and a reduce
kernel merges the splits' softmax partials (decode_reduce.py). An FP8 cache is read as in
prefill.py. Page ids are read a chunk at a time into registers, so the K/V tile loads can be
pipelined.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention import prefill  # dot_precision looked up per call (tests patch)
from nanovllm.kernels.attention.decode_reduce import (
    MAX_SPLITS,
    reduce_splits,
    split_len,
    split_partials,
    store_split,
)
from nanovllm.kernels.attention.new_token import (
    NewToken,
    cached_end,
    empty_state,
    new_kv_heads,
    new_token_args,
    new_token_inputs,
    new_token_steps,
    query_tile,
)
from nanovllm.kernels.attention.pending_merge import PendingMerge
from nanovllm.kernels.attention.prefill import LOG2E, check_shapes, softmax_step
from nanovllm.kernels.attention.reference import check_sliding_window
from nanovllm.kernels.pdl import launch_options, wait_then_release

_MIN_SPLIT_LEN = 256  # fewest keys worth a split of their own
_TARGET_PROGRAMS = 512  # enough programs to fill an H100/H200 a few times over
# An FP8 cache's launch, measured on the H200: 128-key tiles, and a third stage, which keeps two
# K/V tiles in flight (half the bytes per tile of bf16, whose launch gains nothing from it).
# Not with the new token (batch 1): a split is a few tiles there, the first held from before
# the wait, and the third stage buys nothing but shared memory (73,728 bytes, not 40,960).
_FP8_BLOCK_N, _FP8_NUM_WARPS, _FP8_NUM_STAGES = 128, 4, 3
# Block-table entries held in registers at a time: fixed (one compiled variant), small at any
# context length, and 16-64 key tiles per chunk, so the tile pipeline refills only rarely.
_PAGES_PER_CHUNK = 16


@triton.jit
def _cache_tile(k_cache_ptr, v_cache_ptr, pages, page0, start_n, hi_n, lo, kv_head, dtype,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGES_PER_CHUNK: tl.constexpr, SLIDING: tl.constexpr):
    """k_t [D, N], v [N, D] of keys start_n..+BLOCK_N as `dtype`, visible below hi_n (from lo)."""
    # The page id comes from registers, not memory: a load here would make each tile's K/V
    # addresses wait on it, and Triton then keeps one K/V tile in flight at any num_stages.
    page = tl.sum(tl.where(tl.arange(0, PAGES_PER_CHUNK) == start_n // BLOCK_SIZE - page0,
                           pages, 0))
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = page.to(tl.int64) * BLOCK_SIZE + start_n % BLOCK_SIZE + offs_n
    visible = start_n + offs_n < hi_n
    if SLIDING:
        visible &= start_n + offs_n >= lo
    cache_offs = rows * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
    k_t = tl.load(k_cache_ptr + cache_offs[None, :] + offs_d[:, None], mask=visible[None, :],
                  other=0.0).to(dtype)
    v = tl.load(v_cache_ptr + cache_offs[:, None] + offs_d[None, :], mask=visible[:, None],
                other=0.0).to(dtype)
    return k_t, v, visible


@triton.jit
def _attend_chunk(q, k_cache_ptr, v_cache_ptr, pages, page0, lo_n, hi_n, lo, kv_head, m_i, l_i,
                  acc, qk_scale, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGES_PER_CHUNK: tl.constexpr,
                  PRECISION: tl.constexpr, SLIDING: tl.constexpr):
    """Online softmax over the key tiles lo_n..hi_n, whose page ids `pages` (from page0) are held
    in registers; lo_n is a tile boundary and tiles never cross pages."""
    # Hoisted out of the loop, the tile-invariant address math would stay live across both loops:
    # sm_90 then needs ~45 more registers, one program per SM fewer (FP8: 2 instead of 3).
    for start_n in tl.range(lo_n, hi_n, BLOCK_N, disable_licm=True):
        # Only a split's first tile holds keys before lo, and each keeps >= 1 visible (with a
        # new token the first tile comes before this loop: new_token.new_token_steps)
        k_t, v, visible = _cache_tile(k_cache_ptr, v_cache_ptr, pages, page0, start_n, hi_n, lo,
                                      kv_head, q.dtype, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                      BLOCK_N, PAGES_PER_CHUNK, SLIDING)
        m_i, l_i, acc = softmax_step(q, k_t, v, visible[None, :], m_i, l_i, acc, qk_scale,
                                      PRECISION)
    return m_i, l_i, acc


@triton.jit
def _first_tile(k_cache_ptr, v_cache_ptr, pages, start, end, ctx, lo, kv_head,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGES_PER_CHUNK: tl.constexpr, SLIDING: tl.constexpr,
                NEW_KV: tl.constexpr):
    """NEW_KV: the split's first cache tile (codes), read before the PDL wait; else None."""
    if NEW_KV:
        # Only rows before the new position (cached_end), which earlier steps wrote; an empty
        # split's keys are all hidden. Without NEW_KV the loop reads the tile.
        tile = _cache_tile(k_cache_ptr, v_cache_ptr, pages, start // BLOCK_SIZE, start,
                           cached_end(end, ctx, NEW_KV), lo, kv_head,
                           k_cache_ptr.dtype.element_ty, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                           BLOCK_N, PAGES_PER_CHUNK, SLIDING)
    else:
        tile = None
    return tile


@triton.jit
def _chunk_pages(block_tables_ptr, seq, stride_bt, page0, end_page,
                 PAGES_PER_CHUNK: tl.constexpr):
    """Page ids page0..+PAGES_PER_CHUNK of seq's block table, 0 from end_page on."""
    offs_p = tl.arange(0, PAGES_PER_CHUNK)
    return tl.load(block_tables_ptr + seq * stride_bt + page0 + offs_p,
                   mask=page0 + offs_p < end_page, other=0)


@triton.jit
def _split_bounds(context_lens_ptr, seq, split, num_splits, window, BLOCK_N: tl.constexpr,
                  SLIDING: tl.constexpr):
    """(lo, start, end, ctx) of one split: the query (position ctx - 1) sees keys lo..ctx-1,
    spread evenly over all splits in whole key tiles (tiles never cross pages) from lo rounded
    down to a tile. The context lengths are the step's inputs, which no kernel of the step
    writes: read before the PDL wait."""
    ctx = tl.load(context_lens_ptr + seq)
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx - window, 0)
    first = lo // BLOCK_N * BLOCK_N
    keys = split_len(ctx, first, num_splits, BLOCK_N)
    start = first + split * keys
    end = tl.minimum(start + keys, ctx)
    return lo, start, end, ctx


@triton.jit
def _attend_pages(q, k_cache_ptr, v_cache_ptr, block_tables_ptr, pages, seq, stride_bt, start,
                  end_cached, end_page, lo, kv_head, m_i, l_i, acc, qk_scale,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGES_PER_CHUNK: tl.constexpr,
                  PRECISION: tl.constexpr, SLIDING: tl.constexpr, NEW_KV: tl.constexpr):
    """The softmax state (m, l, acc) after the split's cached keys from start (with NEW_KV, its
    first tile is done: new_token_steps) to end_cached; `pages`: the first chunk's entries."""
    # The split's block-table entries come PAGES_PER_CHUNK at a time into registers, so the row
    # held stays small at any context length; each chunk's tiles are one pipelined loop. The
    # first chunk came before the wait; each pass asks for the next before its tiles (past
    # the end: no bytes).
    for page0 in range(start // BLOCK_SIZE, end_page, PAGES_PER_CHUNK):
        next_pages = _chunk_pages(block_tables_ptr, seq, stride_bt, page0 + PAGES_PER_CHUNK,
                                  end_page, PAGES_PER_CHUNK)
        m_i, l_i, acc = _attend_chunk(
            q, k_cache_ptr, v_cache_ptr, pages, page0,
            tl.maximum(start + NEW_KV * BLOCK_N, page0 * BLOCK_SIZE),
            tl.minimum(end_cached, (page0 + PAGES_PER_CHUNK) * BLOCK_SIZE), lo, kv_head, m_i,
            l_i, acc, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGES_PER_CHUNK,
            PRECISION, SLIDING)
        pages = next_pages
    return m_i, l_i, acc


# num_splits is a plain argument, not specialised: the split count depends on the batch size,
# and a constant would compile a variant per CUDA-graph size (seconds of cold start-up); so is
# stride_bt, the block tables' width, which an eager step takes from its longest sequence.
@triton.jit(do_not_specialize=["stride_bt", "num_splits", "window"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, context_lens_ptr, block_tables_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_qb, stride_qh, stride_bt, stride_ob,
    stride_oh, qk_scale, v_scale, num_splits, window, k_new_ptr, v_new_ptr, stride_nb, pos_ptr,
    slot_ptr, cs_ptr, stride_cs, qn_w_ptr, kn_w_ptr, eps, k_inv_scale, v_inv_scale,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGES_PER_CHUNK: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, FP16_DOT: tl.constexpr, NEW_KV: tl.constexpr,
    NORM: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (Hkv, B, splits): all GROUP query heads of one kv head over one slice of the keys.
    With NEW_KV, q, k_new and v_new are qkv_proj's raw output: the kernel normalises and
    rotates them and writes the new K/V itself (kernels.attention.new_token)."""
    # kv heads vary fastest: the programs running together read neighbouring bytes of each
    # cache row ([slot, kv head, dim]), which the H200 streams measurably faster.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    # The split's bounds and first block-table chunk: the step's inputs; with NEW_KV its first
    # cache tile too, rows that only earlier steps wrote (kernels.pdl)
    lo, start, end, ctx = _split_bounds(context_lens_ptr, seq, split, num_splits, window,
                                        BLOCK_N, SLIDING)
    end_cached = cached_end(end, ctx, NEW_KV)
    end_page = tl.cdiv(end_cached, BLOCK_SIZE)
    pages = _chunk_pages(block_tables_ptr, seq, stride_bt, start // BLOCK_SIZE, end_page,
                         PAGES_PER_CHUNK)
    tile = _first_tile(k_cache_ptr, v_cache_ptr, pages, start, end, ctx, lo, kv_head,
                       NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGES_PER_CHUNK, SLIDING,
                       NEW_KV)
    cos, sin, slot, qw1, qw2, kw1, kw2 = new_token_inputs(
        pos_ptr, slot_ptr, cs_ptr, stride_cs, qn_w_ptr, kn_w_ptr, seq, HEAD_DIM, NORM, NEW_KV)
    wait_then_release(USE_PDL)
    if start >= ctx:  # past the context (a short one's splits in a wide CUDA graph): empty
        m_i, l_i, acc = empty_state(GROUP_P2, HEAD_DIM)
        store_split(m_i, l_i, acc, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, seq, kv_head,
                    split, num_splits, stride_ob, stride_oh, v_scale, GROUP, GROUP_P2,
                    NUM_KV_HEADS, HEAD_DIM, SINGLE_SPLIT)
        return
    holds_new = (start <= ctx - 1) & (ctx - 1 < end)
    new_kv = new_kv_heads(k_new_ptr, v_new_ptr, seq * stride_nb + kv_head * HEAD_DIM, holds_new,
                          HEAD_DIM, NEW_KV)
    # GQA packing: [GROUP_P2, D] queries (padded to >= 16 rows for tl.dot) share each K/V load.
    q = query_tile(q_ptr, seq, stride_qb, stride_qh, kv_head, cos, sin, qw1, qw2, eps, GROUP,
                   GROUP_P2, HEAD_DIM, NORM, NEW_KV)
    if FP16_DOT:  # an FP8 cache widens to fp16 in one instruction per pair, exactly
        q = q.to(tl.float16)
    m_i, l_i, acc = new_token_steps(
        q, tile, holds_new, new_kv, k_cache_ptr, v_cache_ptr, slot, kv_head, cos, sin, kw1, kw2,
        eps, k_inv_scale, v_inv_scale, qk_scale, GROUP_P2, NUM_KV_HEADS, HEAD_DIM, PRECISION,
        NORM, FP8, NEW_KV)
    m_i, l_i, acc = _attend_pages(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr, pages, seq, stride_bt, start, end_cached,
        end_page, lo, kv_head, m_i, l_i, acc, qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
        BLOCK_N, PAGES_PER_CHUNK, PRECISION, SLIDING, NEW_KV)
    store_split(m_i, l_i, acc, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, seq, kv_head,
                split, num_splits, stride_ob, stride_oh, v_scale, GROUP, GROUP_P2,
                NUM_KV_HEADS, HEAD_DIM, SINGLE_SPLIT)


def _block_n(programs: int, head_dim: int, block_size: int, fp8: bool) -> int:
    """Keys per tile, dividing block_size (tiles never cross pages): 128 where the H200 measured
    it faster (an FP8 cache, or >= 1024 (sequence, kv head) programs in bf16), else 64."""
    if head_dim > 128:
        return min(32, block_size)
    if fp8:
        return min(_FP8_BLOCK_N, block_size)
    return min(128 if programs >= 1024 else 64, block_size)


def _num_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Splits per (seq, kv head) from shapes only (CUDA-graph safe): long contexts get more."""
    by_length = triton.cdiv(max_context, _MIN_SPLIT_LEN)
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, batch * num_kv_heads)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def _graph_splits(batch: int, num_kv_heads: int, table_keys: int, window: int,
                  block_n: int) -> int:
    """_num_splits for the keys a block table of table_keys can hold (a CUDA graph's: its
    widest), only the window's (from a tile boundary) with one."""
    max_keys = min(table_keys, window + block_n - 1) if window else table_keys
    return _num_splits(batch, num_kv_heads, max_keys)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    new_token: NewToken | None = None,
    defer_merge: bool = False,
) -> torch.Tensor | PendingMerge:
    """Flash-decoding: q [B, H, D] (one query per sequence) over its paged context (an FP8 cache
    dequantized with k_scale, v_scale); 0 -> zeros. With new_token, q and its k and v are
    qkv_proj's raw output: q/k norm, RoPE and the K/V write happen inside (new_token);
    defer_merge: splits come back unmerged, a PendingMerge for o_proj's kernel to merge."""
    window = check_sliding_window(sliding_window)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_shapes(q, k_cache, v_cache, block_size, paged=True)
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    fp8 = k_cache.element_size() == 1
    block_n = _block_n(batch * num_kv_heads, head_dim, block_size, fp8)
    if num_splits is None:
        num_splits = _graph_splits(batch, num_kv_heads, block_tables.shape[1] * block_size,
                                   window, block_n)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits={num_splits}: 1..{MAX_SPLITS}"
    group = num_heads // num_kv_heads
    # with one split (large batches: programs enough) the kernel writes `out`, and no reduce runs.
    part_m, part_l, part_acc = split_partials(batch, num_heads, num_splits, head_dim, q.device)
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, context_lens, block_tables, part_m, part_l, part_acc, out,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E * k_scale, v_scale, num_splits, window,
        GROUP=group, GROUP_P2=max(16, triton.next_power_of_2(group)), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PAGES_PER_CHUNK=_PAGES_PER_CHUNK, PRECISION=prefill.dot_precision(q.dtype),
        SLIDING=window > 0, SINGLE_SPLIT=num_splits == 1,
        FP16_DOT=fp8 and q.dtype == torch.bfloat16, FP8=fp8,
        **new_token_args(new_token, q, (k_scale, v_scale)),
        num_warps=_FP8_NUM_WARPS if fp8 else 4,
        num_stages=_FP8_NUM_STAGES if fp8 and new_token is None else 2,
        **launch_options(),
    )
    if num_splits > 1 and not defer_merge:
        reduce_splits(part_m, part_l, part_acc, out)
    if num_splits > 1 and defer_merge:
        return PendingMerge(part_m, part_l, part_acc, out, context_lens, window, block_n)
    return out
