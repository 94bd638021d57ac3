"""Sliding-window attention (Mistral, Qwen2): Triton prefill and decode against the torch
references, and keys before the window never read (NaN-poisoned caches)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.attention.decode import _PAGES_PER_CHUNK, decode_attention_triton  # noqa: E402
from nanovllm.kernels.attention.prefill import prefill_attention_triton  # noqa: E402
from nanovllm.kernels.attention.reference import (  # noqa: E402
    decode_attention_torch,
    prefill_attention_torch,
)
from tests.kernels.attention_cases import (  # noqa: E402
    DEVICE,
    DTYPES,
    KV_HEADS,
    PAGED_CASES,
    close,
    cu_lens,
    paged_cache,
    paged_pairs,
    poison_before_window,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# Windows smaller than a key tile, not a multiple of any block size,
# equal to a page, crossing the cached prefix, and wider than every sequence.
WINDOWS = [1, 7, 16, 45, 4096] if DEVICE == "cuda" else [1, 45, 4096]
SWA_CASES = PAGED_CASES if DEVICE == "cuda" else [(16, 64, 2), (256, 32, 4)]


def test_sliding_window_rejects_negative() -> None:
    """A negative window is a clear error naming the value, before any kernel runs."""
    k_cache, v_cache, tables = paged_cache([4], 16, 16, torch.float32)
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
    pairs = [*paged_pairs(block_size), (45, 45), (70, 70), (30, 300)]
    q_lens, k_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    k_cache, v_cache, tables = paged_cache(k_lens, block_size, head_dim, dtype)
    q = torch.randn(sum(q_lens), group * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    args = (q, None, None, k_cache, v_cache, cu_lens(q_lens), cu_lens(k_lens), tables,
            head_dim**-0.5)
    close(prefill_attention_triton(*args, sliding_window=window),
          prefill_attention_torch(*args, sliding_window=window), dtype)
    k = torch.randn(sum(q_lens), KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    cu = cu_lens(q_lens)
    dense = (q, k, v, None, None, cu, cu, None, head_dim**-0.5)
    close(prefill_attention_triton(*dense, sliding_window=window),
          prefill_attention_torch(*dense, sliding_window=window), dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_dim", "group"), SWA_CASES)
def test_decode_triton_sliding_window(block_size: int, head_dim: int, group: int,
                                      dtype: torch.dtype, window: int) -> None:
    """Windowed decode over mixed contexts (shorter and longer than the window, padding rows)."""
    lens = [0, 1, 16, 45, 2 * block_size, block_size + 44, 0]
    k_cache, v_cache, tables = paged_cache(lens, block_size, head_dim, dtype)
    q = torch.randn(len(lens), group * KV_HEADS, head_dim, dtype=dtype, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, ctx, tables, head_dim**-0.5)
    out = decode_attention_triton(*args, sliding_window=window)
    close(out, decode_attention_torch(*args, sliding_window=window), dtype)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_triton_sliding_window_long_context(num_splits: int | None) -> None:
    """Contexts far longer than the window read only the window: the splits cover it alone and
    keys before it (poisoned with NaN) are never read."""
    _check_windowed_decode([600, 300, 37, 0], 40, 32, 32, 0.2, num_splits)


def _check_windowed_decode(lens: list[int], window: int, block_size: int, head_dim: int,
                           scale: float, num_splits: int | None) -> None:
    """Triton decode with a window over caches poisoned (NaN) before it == the reference."""
    k_cache, v_cache, tables = paged_cache(lens, block_size, head_dim, torch.float32)
    for cache in (k_cache, v_cache):
        poison_before_window(cache, tables, lens, [max(0, n - window) for n in lens])
    q = torch.randn(len(lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, ctx, tables, scale)
    out = decode_attention_triton(*args, num_splits=num_splits, sliding_window=window)
    assert not out.isnan().any()
    close(out, decode_attention_torch(*args, sliding_window=window), torch.float32)


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
    k_cache, v_cache, tables = paged_cache(k_lens, block_size, head_dim, torch.float32)
    first_visible = [max(0, lk - lq - window + 1) for lq, lk in pairs]
    for cache in (k_cache, v_cache):
        poison_before_window(cache, tables, k_lens, first_visible)
    q = torch.randn(sum(q_lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    args = (q, None, None, k_cache, v_cache, cu_lens(q_lens), cu_lens(k_lens), tables, 0.2)
    out = prefill_attention_triton(*args, sliding_window=window)
    assert not out.isnan().any()
    close(out, prefill_attention_torch(*args, sliding_window=window), torch.float32)


