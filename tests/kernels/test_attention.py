"""Paged attention: torch references vs a naive float64 loop, Triton kernels vs the references."""

import itertools
import os

# The interpreter runs tl.dot on numpy: threaded OpenBLAS on a small busy CPU can be ~100x
# slower for these tiny matmuls. Takes effect only before numpy's first import (torch's).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.attention import prefill as attention_triton  # noqa: E402
from nanovllm.kernels.attention.decode import (  # noqa: E402
    _PAGES_PER_CHUNK,
    _num_splits,
    decode_attention_triton,
)
from nanovllm.kernels.attention.decode_reduce import reduce_splits  # noqa: E402
from nanovllm.kernels.attention.prefill import prefill_attention_triton  # noqa: E402
from nanovllm.kernels.attention.reference import (  # noqa: E402
    decode_attention_torch,
    prefill_attention_torch,
)
from nanovllm.kernels.attention.store_kvcache import store_kvcache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# (block_size, head_dim, group): the full grid on CUDA; under the (slow) interpreter a covering
# subset in which every block_size, head_dim and GQA ratio appears.
PAGED_CASES = (
    list(itertools.product([16, 32, 256], [32, 64, 128], [1, 2, 4])) if DEVICE == "cuda"
    else [(16, 32, 1), (16, 64, 2), (16, 128, 4), (32, 64, 4), (256, 32, 2), (256, 128, 1)]
)
DENSE_CASES = [(d, g) for b, d, g in PAGED_CASES if b != 32]  # (head_dim, group)
KV_HEADS = 2
# (atol, rtol) Triton vs reference; float32 dots run in IEEE precision (dot_precision).
TOL = {torch.float32: (1e-4, 1e-4),
       torch.bfloat16: (3e-2, 3e-2)}
DENSE_LENS = [1, 0, 64, 80]  # incl. an empty sequence and several query tiles


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _paged_pairs(block_size: int) -> list[tuple[int, int]]:
    """Mixed (seqlen_q, seqlen_k) batch: prefix hits, page crossings, exact page multiples."""
    return [(3, 3), (20, 53), (1, 33), (24, 2 * block_size), (8, block_size + 44)]


def _cu(lens: list[int]) -> torch.Tensor:
    """Cumulative sequence lengths [B + 1], int32."""
    return torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)


def _paged_cache(
    lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches (garbage everywhere) and block tables of shuffled ids, padded with -1."""
    per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(per_seq) + 3  # spare blocks never referenced
    ids = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(lens), max(per_seq) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    shape = (num_blocks, block_size, KV_HEADS, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    return k_cache, v_cache, tables.to(DEVICE)


def _gather_naive(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Token-by-token gather of one sequence from the paged cache."""
    bs = cache.shape[1]
    return torch.stack([cache[int(table[p // bs]), p % bs] for p in range(length)])


def _naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: list[int],
           scale: float, window: int = 0) -> torch.Tensor:
    """float64 per-query, per-head causal attention; query i sees keys 0..q_pos[i], or only the
    last `window` of them (transformers: key k visible iff k <= q and q - k < window)."""
    q, keys, values = q.double(), keys.double(), values.double()
    group = q.shape[1] // keys.shape[1]
    out = torch.zeros_like(q)
    for i, pos in enumerate(q_pos):
        lo = max(0, pos - window + 1) if window else 0
        for h in range(q.shape[1]):
            k, v = keys[lo : pos + 1, h // group], values[lo : pos + 1, h // group]
            out[i, h] = torch.softmax(k @ q[i, h] * scale, dim=0) @ v
    return out


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("window", [None, 1, 7, 16])
@pytest.mark.parametrize("paged", [False, True])
def test_prefill_torch_matches_naive(paged: bool, window: int | None) -> None:
    """Reference prefill (dense and paged with prefix hits, GQA 2, sliding windows smaller
    than, equal to and larger than the sequences) against the float64 loop."""
    pairs = [(20, 53), (1, 17), (16, 16)] if paged else [(5, 5), (17, 17), (1, 1)]
    heads, head_dim, block_size, scale = 2 * KV_HEADS, 16, 16, 0.3
    q_lens, k_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEVICE)
    k = torch.randn(sum(k_lens), KV_HEADS, head_dim, device=DEVICE)
    v = torch.randn_like(k)
    k_cache, v_cache, tables = _paged_cache(k_lens, block_size, head_dim, torch.float32)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    out = prefill_attention_torch(q, k, v, k_cache, v_cache, cu_q, cu_k,
                                  tables if paged else None, scale, sliding_window=window)
    for b, (len_q, len_k) in enumerate(pairs):
        if paged:
            keys = _gather_naive(k_cache, tables[b], len_k)
            values = _gather_naive(v_cache, tables[b], len_k)
        else:
            keys, values = k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        q_pos = [len_k - len_q + i for i in range(len_q)]
        expected = _naive(q[cu_q[b] : cu_q[b + 1]], keys, values, q_pos, scale, window or 0)
        torch.testing.assert_close(out[cu_q[b] : cu_q[b + 1]].double(), expected,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 17, 20])
def test_decode_torch_matches_naive(window: int | None) -> None:
    """Reference decode (GQA 4, padding rows, sliding windows) against the float64 loop."""
    lens, heads, head_dim, scale = [0, 1, 17, 33, 0], 4 * KV_HEADS, 16, 0.25
    k_cache, v_cache, tables = _paged_cache(lens, 16, head_dim, torch.float32)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention_torch(q, k_cache, v_cache, ctx, tables, scale, sliding_window=window)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        keys = _gather_naive(k_cache, tables[b], n)
        values = _gather_naive(v_cache, tables[b], n)
        expected = _naive(q[b : b + 1], keys, values, [n - 1], scale, window or 0)[0]
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "group"), sorted(set(DENSE_CASES)))
def test_prefill_triton_dense(head_dim: int, group: int, dtype: torch.dtype) -> None:
    """Dense varlen prefill on strided q/k/v views (as split from a fused qkv projection)."""
    heads, n = group * KV_HEADS, sum(DENSE_LENS)
    qkv = torch.randn(n, (heads + 2 * KV_HEADS) * head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([heads * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], dim=-1)
    q, k, v = q.view(n, heads, head_dim), k.view(n, -1, head_dim), v.view(n, -1, head_dim)
    cu = _cu(DENSE_LENS)
    args = (q, k, v, None, None, cu, cu, None, head_dim**-0.5)
    _close(prefill_attention_triton(*args), prefill_attention_torch(*args), dtype)


def test_prefill_triton_many_sequences() -> None:
    """More sequences than one chunk of the tile search (64), empty ones among them, map each
    query tile to its own sequence."""
    lens = [(7 * i) % 23 for i in range(70)]  # 0..22 queries each, several zeros
    q = torch.randn(sum(lens), KV_HEADS, 16, device=DEVICE)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = _cu(lens)
    args = (q, k, v, None, None, cu, cu, None, 0.25)
    _close(prefill_attention_triton(*args), prefill_attention_torch(*args), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_dim", "group"), PAGED_CASES)
def test_prefill_triton_paged(block_size: int, head_dim: int, group: int,
                              dtype: torch.dtype) -> None:
    """Paged prefill with cached prefixes, shuffled block ids and -1 table padding."""
    pairs = _paged_pairs(block_size)
    q_lens, k_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    k_cache, v_cache, tables = _paged_cache(k_lens, block_size, head_dim, dtype)
    q = torch.randn(sum(q_lens), group * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    args = (q, None, None, k_cache, v_cache, _cu(q_lens), _cu(k_lens), tables, head_dim**-0.5)
    _close(prefill_attention_triton(*args), prefill_attention_torch(*args), dtype)


def test_prefill_triton_paged_matches_dense() -> None:
    """store_kvcache then paged prefill (given max_seqlen_q) equals dense prefill."""
    lens, block_size, head_dim, heads = [40, 16, 5], 16, 32, 2 * KV_HEADS
    k_cache, v_cache, tables = _paged_cache(lens, block_size, head_dim, torch.float32)
    q = torch.randn(sum(lens), heads, head_dim, device=DEVICE)
    k = torch.randn(sum(lens), KV_HEADS, head_dim, device=DEVICE)
    v = torch.randn_like(k)
    slots = torch.cat([tables[b, torch.arange(n, device=DEVICE) // block_size] * block_size
                       + torch.arange(n, device=DEVICE) % block_size
                       for b, n in enumerate(lens)]).to(torch.int32)
    store_kvcache(k, v, k_cache, v_cache, slots)
    cu = _cu(lens)
    dense = prefill_attention_triton(q, k, v, None, None, cu, cu, None, 0.2)
    paged = prefill_attention_triton(q, None, None, k_cache, v_cache, cu, cu, tables, 0.2,
                                     max_seqlen_q=max(lens))
    _close(paged, dense, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_dim", "group"), PAGED_CASES)
def test_decode_triton(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    """Decode over mixed contexts (incl. exact page multiples) with context_len 0 padding rows."""
    lens = [0, 1, 16, 45, 2 * block_size, block_size + 44, 0]
    k_cache, v_cache, tables = _paged_cache(lens, block_size, head_dim, dtype)
    q = torch.randn(len(lens), group * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention_triton(q, k_cache, v_cache, ctx, tables, head_dim**-0.5)
    _close(out, decode_attention_torch(q, k_cache, v_cache, ctx, tables, head_dim**-0.5), dtype)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_triton_long_context_splits(num_splits: int | None) -> None:
    """Long contexts spread over several splits (auto and forced counts) give the same result."""
    lens, block_size, head_dim, heads = [600, 300, 5, 0], 32, 32, 2 * KV_HEADS
    k_cache, v_cache, tables = _paged_cache(lens, block_size, head_dim, torch.float32)
    assert _num_splits(len(lens), KV_HEADS, tables.shape[1] * block_size) > 1
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention_triton(q, k_cache, v_cache, ctx, tables, 0.2, num_splits=num_splits)
    _close(out, decode_attention_torch(q, k_cache, v_cache, ctx, tables, 0.2), torch.float32)


def test_decode_triton_splits_past_the_context_store_empty_partials() -> None:
    """Splits past a short context (a wide CUDA graph's) store m=-inf, l=0, acc=0, which
    merge to the reference; a padding row's splits are all empty."""
    lens, block_size, head_dim, heads, splits = [37, 5, 0], 32, 32, 2 * KV_HEADS, 16
    k_cache, v_cache, tables = _paged_cache(lens, block_size, head_dim, torch.float32)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    pending = decode_attention_triton(q, k_cache, v_cache, ctx, tables, 0.2, num_splits=splits,
                                      defer_merge=True)
    live = [2, 1, 0]  # splits of 32 keys holding a key of each context
    for row, n in enumerate(live):
        assert (pending.part_m[row, :, n:] == float("-inf")).all()
        assert (pending.part_l[row, :, n:] == 0).all() and (pending.part_acc[row, :, n:] == 0).all()
        assert (pending.part_m[row, :, :n] > float("-inf")).all()
    reduce_splits(pending.part_m, pending.part_l, pending.part_acc, pending.out)
    _close(pending.out, decode_attention_torch(q, k_cache, v_cache, ctx, tables, 0.2),
           torch.float32)


# Sliding windows (Mistral, Qwen2): smaller than a key tile, not a multiple of any block size,
# equal to a page, crossing the cached prefix, and wider than every sequence.
WINDOWS = [1, 7, 16, 45, 4096] if DEVICE == "cuda" else [1, 45, 4096]
SWA_CASES = PAGED_CASES if DEVICE == "cuda" else [(16, 64, 2), (256, 32, 4)]


def test_sliding_window_rejects_negative() -> None:
    """A negative window is a clear error naming the value, before any kernel runs."""
    k_cache, v_cache, tables = _paged_cache([4], 16, 16, torch.float32)
    q = torch.randn(1, KV_HEADS, 16, device=DEVICE)
    ctx = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    for decode in (decode_attention_torch, decode_attention_triton):
        with pytest.raises(ValueError, match="-3"):
            decode(q, k_cache, v_cache, ctx, tables, 0.1, sliding_window=-3)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_dim", "group"), SWA_CASES)
def test_prefill_triton_sliding_window(block_size: int, head_dim: int, group: int,
                                       dtype: torch.dtype, window: int) -> None:
    """Windowed prefill, dense and paged with cached prefixes crossing the window edge."""
    pairs = [*_paged_pairs(block_size), (45, 45), (70, 70), (30, 300)]
    q_lens, k_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    k_cache, v_cache, tables = _paged_cache(k_lens, block_size, head_dim, dtype)
    q = torch.randn(sum(q_lens), group * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    args = (q, None, None, k_cache, v_cache, _cu(q_lens), _cu(k_lens), tables, head_dim**-0.5)
    _close(prefill_attention_triton(*args, sliding_window=window),
           prefill_attention_torch(*args, sliding_window=window), dtype)
    k = torch.randn(sum(q_lens), KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    cu = _cu(q_lens)
    dense = (q, k, v, None, None, cu, cu, None, head_dim**-0.5)
    _close(prefill_attention_triton(*dense, sliding_window=window),
           prefill_attention_torch(*dense, sliding_window=window), dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_dim", "group"), SWA_CASES)
def test_decode_triton_sliding_window(block_size: int, head_dim: int, group: int,
                                      dtype: torch.dtype, window: int) -> None:
    """Windowed decode over mixed contexts (shorter and longer than the window, padding rows)."""
    lens = [0, 1, 16, 45, 2 * block_size, block_size + 44, 0]
    k_cache, v_cache, tables = _paged_cache(lens, block_size, head_dim, dtype)
    q = torch.randn(len(lens), group * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, ctx, tables, head_dim**-0.5)
    out = decode_attention_triton(*args, sliding_window=window)
    _close(out, decode_attention_torch(*args, sliding_window=window), dtype)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()


def _poison_before_window(cache: torch.Tensor, tables: torch.Tensor, lens: list[int],
                          first_visible: list[int]) -> None:
    """NaN in every cached key/value no query can see: reading one would show in the output."""
    bs = cache.shape[1]
    for b, (n, lo) in enumerate(zip(lens, first_visible, strict=True)):
        for p in range(min(lo, n)):
            cache[int(tables[b, p // bs]), p % bs] = float("nan")


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_triton_sliding_window_long_context(num_splits: int | None) -> None:
    """Contexts far longer than the window read only the window: the splits cover it alone and
    keys before it (poisoned with NaN) are never read."""
    _check_windowed_decode([600, 300, 37, 0], 40, 32, 32, 0.2, num_splits)


def _check_windowed_decode(lens: list[int], window: int, block_size: int, head_dim: int,
                           scale: float, num_splits: int | None) -> None:
    """Triton decode with a window over caches poisoned (NaN) before it == the reference."""
    k_cache, v_cache, tables = _paged_cache(lens, block_size, head_dim, torch.float32)
    for cache in (k_cache, v_cache):
        _poison_before_window(cache, tables, lens, [max(0, n - window) for n in lens])
    q = torch.randn(len(lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, ctx, tables, scale)
    out = decode_attention_triton(*args, num_splits=num_splits, sliding_window=window)
    assert not out.isnan().any()
    _close(out, decode_attention_torch(*args, sliding_window=window), torch.float32)


@pytest.mark.parametrize("num_splits", [None, 1, 2])
def test_decode_triton_page_chunks(num_splits: int | None) -> None:
    """Splits longer than a chunk of block-table entries (16-key pages; 1 and 2 splits cross
    chunk edges, from page 0 and from mid-table), contexts ending on and just past an edge."""
    block_size, head_dim, chunk_keys = 16, 16, _PAGES_PER_CHUNK * 16
    lens = [2 * chunk_keys + 37, chunk_keys, chunk_keys + 1, 5, 0]
    k_cache, v_cache, tables = _paged_cache(lens, block_size, head_dim, torch.float32)
    q = torch.randn(len(lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, ctx, tables, 0.3)
    out = decode_attention_triton(*args, num_splits=num_splits)
    _close(out, decode_attention_torch(*args), torch.float32)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize(("num_splits", "window"), [(1, 300), (2, 519)])
def test_decode_triton_sliding_window_page_chunks(num_splits: int, window: int) -> None:
    """Windows over more than a chunk of 16-key pages, starting mid-page (and, at 300, in the
    last page of a chunk): only the window's keys are read."""
    chunk_keys = _PAGES_PER_CHUNK * 16
    _check_windowed_decode([2 * chunk_keys + 21, chunk_keys + 3, 40, 0], window, 16, 16, 0.3,
                           num_splits)


def test_prefill_triton_sliding_window_skips_old_prefix() -> None:
    """A short prefill after a long cached prefix never reads keys before its first window."""
    pairs, window, block_size, head_dim = [(20, 400), (3, 90), (64, 64)], 50, 16, 32
    q_lens, k_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    k_cache, v_cache, tables = _paged_cache(k_lens, block_size, head_dim, torch.float32)
    first_visible = [max(0, lk - lq - window + 1) for lq, lk in pairs]
    for cache in (k_cache, v_cache):
        _poison_before_window(cache, tables, k_lens, first_visible)
    q = torch.randn(sum(q_lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    args = (q, None, None, k_cache, v_cache, _cu(q_lens), _cu(k_lens), tables, 0.2)
    out = prefill_attention_triton(*args, sliding_window=window)
    assert not out.isnan().any()
    _close(out, prefill_attention_torch(*args, sliding_window=window), torch.float32)


def test_decode_triton_large_batch() -> None:
    """Batches with >= 1024 (sequence, kv head) programs take 128-key tiles: same result."""
    lens = [(7 * i) % 300 for i in range(1024 // KV_HEADS)]
    block_size, head_dim = 128, 16
    k_cache, v_cache, tables = _paged_cache(lens, block_size, head_dim, torch.float32)
    q = torch.randn(len(lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention_triton(q, k_cache, v_cache, ctx, tables, 0.25)
    _close(out, decode_attention_torch(q, k_cache, v_cache, ctx, tables, 0.25), torch.float32)


@pytest.mark.parametrize("paged", [False, True])
def test_prefill_triton_long_prompt_launch(monkeypatch: pytest.MonkeyPatch, paged: bool) -> None:
    """The long-prompt launch (128 x 128 tiles, taken from _LONG_PROMPT queries on) matches the
    torch reference; the threshold is lowered so that short sequences take it."""
    monkeypatch.setattr(attention_triton, "_LONG_PROMPT", 100)
    assert attention_triton._prefill_config(128, 256, 2, 100) == (128, 128, 8, 3)
    assert attention_triton._prefill_config(128, 256, 2, 99)[:2] == (64, 64)
    dtype, head_dim, block_size = torch.float16, 128, 256
    pairs = [(150, 150), (100, 400), (30, 300)]  # the longest query run decides the launch
    q_lens, k_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    q = torch.randn(sum(q_lens), 2 * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    if paged:
        k_cache, v_cache, tables = _paged_cache(k_lens, block_size, head_dim, dtype)
        args = (q, None, None, k_cache, v_cache, _cu(q_lens), _cu(k_lens), tables, 0.1)
    else:
        k, v = (torch.randn(sum(q_lens), KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
                for _ in range(2))
        args = (q, k, v, None, None, _cu(q_lens), _cu(q_lens), None, 0.1)
    out = prefill_attention_triton(*args, max_seqlen_q=max(q_lens))
    _close(out, prefill_attention_torch(*args), torch.bfloat16)  # 16-bit tolerance
