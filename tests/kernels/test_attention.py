"""Paged attention: torch references vs a naive float64 loop, Triton kernels vs the references."""

import os

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
from tests.kernels.attention_cases import (  # noqa: E402
    DEVICE,
    DTYPES,
    KV_HEADS,
    PAGED_CASES,
    close,
    cu_lens,
    paged_cache,
    paged_pairs,
)

DENSE_CASES = [(d, g) for b, d, g in PAGED_CASES if b != 32]  # (head_dim, group)
DENSE_LENS = [1, 0, 64, 80]  # incl. an empty sequence and several query tiles


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


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
    k_cache, v_cache, tables = paged_cache(k_lens, block_size, head_dim, torch.float32)
    cu_q, cu_k = cu_lens(q_lens), cu_lens(k_lens)
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
    k_cache, v_cache, tables = paged_cache(lens, 16, head_dim, torch.float32)
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
    cu = cu_lens(DENSE_LENS)
    args = (q, k, v, None, None, cu, cu, None, head_dim**-0.5)
    close(prefill_attention_triton(*args), prefill_attention_torch(*args), dtype)


def test_prefill_triton_many_sequences() -> None:
    """More sequences than one chunk of the tile search (64), empty ones among them, map each
    query tile to its own sequence."""
    lens = [(7 * i) % 23 for i in range(70)]  # 0..22 queries each, several zeros
    q = torch.randn(sum(lens), KV_HEADS, 16, device=DEVICE)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = cu_lens(lens)
    args = (q, k, v, None, None, cu, cu, None, 0.25)
    close(prefill_attention_triton(*args), prefill_attention_torch(*args), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_dim", "group"), PAGED_CASES)
def test_prefill_triton_paged(block_size: int, head_dim: int, group: int,
                              dtype: torch.dtype) -> None:
    """Paged prefill with cached prefixes, shuffled block ids and -1 table padding."""
    pairs = paged_pairs(block_size)
    q_lens, k_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    k_cache, v_cache, tables = paged_cache(k_lens, block_size, head_dim, dtype)
    q = torch.randn(sum(q_lens), group * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    args = (q, None, None, k_cache, v_cache, cu_lens(q_lens), cu_lens(k_lens), tables,
            head_dim**-0.5)
    close(prefill_attention_triton(*args), prefill_attention_torch(*args), dtype)


def test_prefill_triton_paged_matches_dense() -> None:
    """store_kvcache then paged prefill (given max_seqlen_q) equals dense prefill."""
    lens, block_size, head_dim, heads = [40, 16, 5], 16, 32, 2 * KV_HEADS
    k_cache, v_cache, tables = paged_cache(lens, block_size, head_dim, torch.float32)
    q = torch.randn(sum(lens), heads, head_dim, device=DEVICE)
    k = torch.randn(sum(lens), KV_HEADS, head_dim, device=DEVICE)
    v = torch.randn_like(k)
    slots = torch.cat([tables[b, torch.arange(n, device=DEVICE) // block_size] * block_size
                       + torch.arange(n, device=DEVICE) % block_size
                       for b, n in enumerate(lens)]).to(torch.int32)
    store_kvcache(k, v, k_cache, v_cache, slots)
    cu = cu_lens(lens)
    dense = prefill_attention_triton(q, k, v, None, None, cu, cu, None, 0.2)
    paged = prefill_attention_triton(q, None, None, k_cache, v_cache, cu, cu, tables, 0.2,
                                     max_seqlen_q=max(lens))
    close(paged, dense, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_dim", "group"), PAGED_CASES)
def test_decode_triton(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    """Decode over mixed contexts (incl. exact page multiples) with context_len 0 padding rows."""
    lens = [0, 1, 16, 45, 2 * block_size, block_size + 44, 0]
    k_cache, v_cache, tables = paged_cache(lens, block_size, head_dim, dtype)
    q = torch.randn(len(lens), group * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention_triton(q, k_cache, v_cache, ctx, tables, head_dim**-0.5)
    close(out, decode_attention_torch(q, k_cache, v_cache, ctx, tables, head_dim**-0.5), dtype)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_triton_long_context_splits(num_splits: int | None) -> None:
    """Long contexts spread over several splits (auto and forced counts) give the same result."""
    lens, block_size, head_dim, heads = [600, 300, 5, 0], 32, 32, 2 * KV_HEADS
    k_cache, v_cache, tables = paged_cache(lens, block_size, head_dim, torch.float32)
    assert _num_splits(len(lens), KV_HEADS, tables.shape[1] * block_size) > 1
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention_triton(q, k_cache, v_cache, ctx, tables, 0.2, num_splits=num_splits)
    close(out, decode_attention_torch(q, k_cache, v_cache, ctx, tables, 0.2), torch.float32)


def test_decode_triton_splits_past_the_context_store_empty_partials() -> None:
    """Splits past a short context (a wide CUDA graph's) store m=-inf, l=0, acc=0, which
    merge to the reference; a padding row's splits are all empty."""
    lens, block_size, head_dim, heads, splits = [37, 5, 0], 32, 32, 2 * KV_HEADS, 16
    k_cache, v_cache, tables = paged_cache(lens, block_size, head_dim, torch.float32)
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
    close(pending.out, decode_attention_torch(q, k_cache, v_cache, ctx, tables, 0.2),
          torch.float32)


@pytest.mark.parametrize("num_splits", [None, 1, 2])
def test_decode_triton_page_chunks(num_splits: int | None) -> None:
    """Splits longer than a chunk of block-table entries (16-key pages; 1 and 2 splits cross
    chunk edges, from page 0 and from mid-table), contexts ending on and just past an edge."""
    block_size, head_dim, chunk_keys = 16, 16, _PAGES_PER_CHUNK * 16
    lens = [2 * chunk_keys + 37, chunk_keys, chunk_keys + 1, 5, 0]
    k_cache, v_cache, tables = paged_cache(lens, block_size, head_dim, torch.float32)
    q = torch.randn(len(lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, ctx, tables, 0.3)
    out = decode_attention_triton(*args, num_splits=num_splits)
    close(out, decode_attention_torch(*args), torch.float32)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_decode_triton_large_batch() -> None:
    """Batches with >= 1024 (sequence, kv head) programs take 128-key tiles: same result."""
    lens = [(7 * i) % 300 for i in range(1024 // KV_HEADS)]
    block_size, head_dim = 128, 16
    k_cache, v_cache, tables = paged_cache(lens, block_size, head_dim, torch.float32)
    q = torch.randn(len(lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention_triton(q, k_cache, v_cache, ctx, tables, 0.25)
    close(out, decode_attention_torch(q, k_cache, v_cache, ctx, tables, 0.25), torch.float32)


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
        k_cache, v_cache, tables = paged_cache(k_lens, block_size, head_dim, dtype)
        args = (q, None, None, k_cache, v_cache, cu_lens(q_lens), cu_lens(k_lens), tables, 0.1)
    else:
        k, v = (torch.randn(sum(q_lens), KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
                for _ in range(2))
        args = (q, k, v, None, None, cu_lens(q_lens), cu_lens(q_lens), None, 0.1)
    out = prefill_attention_triton(*args, max_seqlen_q=max(q_lens))
    close(out, prefill_attention_torch(*args), torch.bfloat16)  # 16-bit tolerance
