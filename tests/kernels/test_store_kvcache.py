"""Triton store_kvcache vs its torch reference (runs under TRITON_INTERPRET=1 without a GPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.attention.store_kvcache import store_kvcache, store_kvcache_torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _qkv_views(
    num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as non-contiguous views of one fused qkv projection output."""
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim),
            v.view(-1, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [16, 256])
def test_store_kvcache_matches_torch(
    block_size: int, head_dim: int, kv_heads: int, dtype: torch.dtype
) -> None:
    """Strided k/v rows land at their slots; -1 rows are skipped; other slots stay untouched."""
    torch.manual_seed(0)
    num_blocks, num_tokens = 5, 40
    _, key, value = _qkv_views(num_tokens, 2 * kv_heads, kv_heads, head_dim, dtype)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens].to(torch.int32)
    slots[::7] = -1  # padding rows
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    store_kvcache_torch(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    valid = slots >= 0
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots[valid].long()], key[valid])


def test_store_kvcache_all_skipped_and_empty() -> None:
    """All-padding and zero-token batches leave the cache unchanged."""
    k_cache = torch.randn(2, 16, 2, 32, device=DEVICE)
    v_cache = torch.randn(2, 16, 2, 32, device=DEVICE)
    before = k_cache.clone(), v_cache.clone()
    key = torch.randn(4, 2, 32, device=DEVICE)
    store_kvcache(key, key, k_cache, v_cache, torch.full((4,), -1, dtype=torch.int32,
                                                         device=DEVICE))
    store_kvcache(key[:0], key[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int32,
                                                                  device=DEVICE))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
