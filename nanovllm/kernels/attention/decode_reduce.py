"""Flash-decoding's split partials (kernels.attention.decode): their store, and their merge,
by a launch of its own or inside the o_proj kernel that reads the output
(pending_merge.PendingMerge: a lone token's GEMV, 2-16 tokens' split-K)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import launch_options, wait_then_release

MAX_SPLITS = 64  # the most splits one decode launch takes


@triton.jit
def store_split(m_i, l_i, acc, part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, seq, kv_head,
                split, num_splits, stride_ob, stride_oh, v_scale, GROUP: tl.constexpr,
                GROUP_P2: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                SINGLE_SPLIT: tl.constexpr):
    """A split's GROUP heads: with one split the output, else partials [B, H, splits(, D)]."""
    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    if SINGLE_SPLIT:  # context_len 0 (a padding row) keeps l = 0 and acc = 0: zeros out
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:  # an empty split stores m=-inf, l=0, acc=0
        part = ((seq * NUM_KV_HEADS + kv_head) * GROUP + offs_g) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc * v_scale,
                 mask=g_mask[:, None])


MERGE_CHUNK = 16  # splits a merging GEMV program loads at once
# ... and a merging split-K program (16 tokens): at batch 16's 4 splits, 4 at once spilled
# registers on sm_90 and 1 waited for four round trips (docs/design.md)
MERGE_ROWS_CHUNK = tl.constexpr(2)


@triton.jit
def split_len(ctx, first, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split of a one-token decode whose query sees keys from `first` (a tile
    boundary) to ctx - 1, spread evenly over num_splits splits in whole BLOCK_N tiles."""
    return tl.cdiv(ctx - first, num_splits * BLOCK_N) * BLOCK_N


@triton.jit
def live_splits(context_lens_ptr, num_splits, window, BLOCK_N: tl.constexpr,
                KNOWN: tl.constexpr):
    """With KNOWN, the splits of a one-token decode of context_lens[0] keys that hold one:
    the decode's own split_len on the step's inputs, so a merge may take it before its PDL
    wait. Without, num_splits (merged_heads then finds them from the maxima)."""
    live = num_splits
    if KNOWN:
        ctx = tl.load(context_lens_ptr)
        first = tl.where(window > 0, tl.maximum(ctx - window, 0) // BLOCK_N * BLOCK_N, 0)
        live = tl.cdiv(ctx - first, tl.maximum(split_len(ctx, first, num_splits, BLOCK_N), 1))
    return live


@triton.jit
def _live_end(part_m_ptr, heads, num_splits, SPLITS_P2: tl.constexpr):
    """One past the last split of `heads` holding a key (m > -inf), from their maxima."""
    splits = tl.arange(0, SPLITS_P2)
    m = tl.load(part_m_ptr + heads[:, None] * num_splits + splits[None, :],
                mask=splits[None, :] < num_splits, other=float("-inf"))
    return tl.max(tl.max(tl.where(m > float("-inf"), splits[None, :] + 1, 0), axis=1))


@triton.jit
def _merge_chunks(part_m_ptr, part_l_ptr, part_acc_ptr, first, rows_live, end,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """float32 [ROWS, HEAD_DIM]: each row's splits 0..end (its partials from index first[row];
    rows not rows_live read nothing, zeros) merged CHUNK at a time, each chunk one round
    trip: the sums so far rescale to the running max (decode_reduce_kernel's formula; past
    one chunk, float32 roundings may differ)."""
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([ROWS], float("-inf"), tl.float32)
    denom = tl.zeros([ROWS], tl.float32)
    o = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for s0 in range(0, end, CHUNK):
        part = first[:, None] + s0 + offs_c[None, :]  # [ROWS, CHUNK]
        used = rows_live[:, None] & (s0 + offs_c[None, :] < end)
        m_c = tl.load(part_m_ptr + part, mask=used, other=float("-inf"))
        l_c = tl.load(part_l_ptr + part, mask=used, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=used[:, :, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_c, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m_c - m_ref[:, None])  # empty splits (m = -inf) weigh 0
        denom = denom * alpha + tl.sum(w * l_c, axis=1)
        o = o * alpha[:, None] + tl.sum(w[:, :, None] * acc, axis=1)
        m_run = m_new
    return o / tl.where(denom == 0.0, 1.0, denom)[:, None]


@triton.jit
def merged_heads(part_m_ptr, part_l_ptr, part_acc_ptr, head0, num_splits, live,
                 dtype: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 SPLITS_P2: tl.constexpr, CHUNK: tl.constexpr, KNOWN: tl.constexpr):
    """float32 [HEADS * D]: heads head0.. of a one-token decode, merged from their splits
    (_merge_chunks) and rounded to dtype as decode_reduce_kernel's output is. With KNOWN,
    `live` splits hold a key (live_splits); else the splits' maxima say which do (one more
    round trip)."""
    heads = head0 + tl.arange(0, HEADS)
    # Splits past the last holding a key (a CUDA graph's split count is its widest block
    # table's, so most of a short context's are empty) weigh 0: their partials are not read
    live_end = live if KNOWN else _live_end(part_m_ptr, heads, num_splits, SPLITS_P2)
    o = _merge_chunks(part_m_ptr, part_l_ptr, part_acc_ptr, heads * num_splits,
                      tl.full([HEADS], True, tl.int1), live_end, HEADS, HEAD_DIM, CHUNK)
    return tl.reshape(o.to(dtype).to(tl.float32), [HEADS * HEAD_DIM])


@triton.jit
def merged_rows(part_m_ptr, part_l_ptr, part_acc_ptr, tok0, head, num_tokens, num_heads,
                num_splits, dtype: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
                CHUNK: tl.constexpr):
    """[BLOCK_T, HEAD_DIM] in dtype: head `head` of tokens tok0.. (zeros from num_tokens on)
    of a decode's output, merged from its splits (_merge_chunks) and rounded to dtype as
    decode_reduce_kernel's output is."""
    toks = tok0 + tl.arange(0, BLOCK_T)
    live = toks < num_tokens
    row = (toks * num_heads + head) * num_splits  # [BLOCK_T]: the first split's partial
    o = _merge_chunks(part_m_ptr, part_l_ptr, part_acc_ptr, row, live, num_splits, BLOCK_T,
                      HEAD_DIM, CHUNK)
    return o.to(dtype)


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (B, H): merge the per-split softmax partials of one query head."""
    wait_then_release(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = splits < num_splits
    part = (seq * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # context_len 0: every split empty
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) get weight 0
    denom = tl.sum(w * l_sum, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)  # zeros if empty
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def split_partials(batch: int, num_heads: int, num_splits: int, head_dim: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The splits' float32 (m, l, acc) scratch, sized from shapes only (no data-dependent
    allocation under graph capture)."""
    part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    part_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                           device=device)
    return part_m, torch.empty_like(part_m), part_acc


def reduce_splits(part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor,
                  out: torch.Tensor) -> None:
    """Merge split_partials' softmax partials into out [B, H, D]."""
    batch, num_heads, num_splits, head_dim = part_acc.shape
    decode_reduce_kernel[(batch, num_heads)](
        part_m, part_l, part_acc, out, out.stride(0), out.stride(1), num_splits,
        # the most splits, whatever this step's count: one compiled variant
        NUM_HEADS=num_heads, SPLITS_P2=MAX_SPLITS, HEAD_DIM=head_dim, **launch_options(),
    )
