"""Decode attention taking qkv_proj's raw output (kernels.attention.new_token) against
qk_norm_rope writing the K/V, then decode attention over the cache (TRITON_INTERPRET on CPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.attention.decode import decode_attention_triton  # noqa: E402
from nanovllm.kernels.attention.kv_quant import FP8_DTYPE  # noqa: E402
from nanovllm.kernels.attention.new_token import NewToken  # noqa: E402
from nanovllm.kernels.attention.qk_norm_rope import qk_norm_rope  # noqa: E402
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS, BLOCK, MAX_POS = 2, 16, 512


def _case(lens: list[int], group: int, head_dim: int, dtype: torch.dtype, cache_dtype,
          block: int = BLOCK):
    """(raw qkv [B, H + 2 Hkv, D], caches of garbage (pages of `block` keys), block tables as
    wide as 512 keys, context lengths, positions, slots): sequence b's new token at position
    lens[b] - 1 (padding: 0)."""
    batch = len(lens)
    per_seq = [max(1, -(-n // block)) for n in lens]
    ids = torch.randperm(sum(per_seq) + 2).tolist()
    tables = torch.zeros(batch, max(MAX_POS // block, max(per_seq) + 1), dtype=torch.int32)
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    shape = (sum(per_seq) + 2, block, KV_HEADS, head_dim)
    k_cache, v_cache = (torch.randn(shape, device=DEVICE).to(cache_dtype) for _ in range(2))
    positions = torch.tensor([max(n - 1, 0) for n in lens], device=DEVICE)
    slots = torch.tensor([int(tables[b, (n - 1) // block]) * block + (n - 1) % block if n else -1
                          for b, n in enumerate(lens)], device=DEVICE)
    qkv = (torch.randn(batch, (group + 2) * KV_HEADS, head_dim, device=DEVICE) * 3).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return qkv, k_cache, v_cache, tables.to(DEVICE), ctx, positions, slots


# Key tiles here are 16 keys, one page (_block_n), and a block-table chunk 16 pages. Each split's
# first cache tile is read before the PDL wait and taken ahead of the others (new_token_steps):
# the cases give it one tile (40 over 3 splits), several over two chunks (300, 290, 500 in one
# split), none but the new key (17 over 3 splits: a split starting at it), no key at all (more
# splits than tiles), keys before a window's start, and the new key first in a tile (17, 33,
# 273, 65, 129) or second (2, 18, 34, 290).
CASES = [  # (lens, group, head_dim, norm, num_splits, window, fp8 cache)
    ([1, 40, 17, 0], 2, 32, True, 1, None, False),
    ([1, 40, 17, 0], 2, 32, True, 3, None, False),
    ([70, 33, 5], 4, 16, False, 5, None, False),
    ([70, 33, 5], 1, 32, True, 2, 20, False),
    ([70, 33, 2], 8, 16, True, 3, 1, False),  # a window of 1: only the new key
    ([300, 2], 2, 16, True, None, None, False),  # splits as a graph's wide table picks
    ([40, 9, 0], 2, 32, True, 2, None, True),
    ([300, 290, 18], 2, 16, True, 1, None, False),  # one split over two chunks
    ([500, 273], 2, 16, True, 1, 400, True),  # from key 96 (window from 100) over two chunks
    ([65, 34, 1], 4, 16, True, 8, 3, True),  # first tiles partly hidden, then empty splits
    ([17, 129, 49], 2, 32, False, 2, 1, True),  # a window of 1 at a tile's first key
]
# Pages of 128 keys (FP8: 256) hold two tiles of 64 (128): splits and windows start inside
# a page (190 over 3 splits; 300 from key 128, its window from 200), one split's tiles go on
# in the first tile's page and past it, new keys at a tile's first key inside a page (65; 129
# with FP8) and at a page's (129)
PAGE_CASES = [  # the same, and the keys per page
    ([190, 129, 65], 2, 32, True, 3, None, False, 128),
    ([300, 200], 4, 32, False, 1, None, False, 128),
    ([300, 129, 2], 2, 32, True, 2, 100, True, 256),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,group,head_dim,norm,num_splits,window,fp8,block",
                         [case + (BLOCK,) for case in CASES] + PAGE_CASES)
def test_new_token_inside_decode(lens, group, head_dim, norm, num_splits, window, fp8, block,
                                 dtype) -> None:
    """Same output (to the online softmax's order) and the same cache, the new token's slot
    (garbage before) written by the kernel, padding rows untouched and zero."""
    torch.manual_seed(len(lens) + (num_splits or 0))
    qkv, k_cache, v_cache, tables, ctx, positions, slots = _case(
        lens, group, head_dim, dtype, FP8_DTYPE if fp8 else dtype, block)
    q, k, v = qkv.split([group * KV_HEADS, KV_HEADS, KV_HEADS], dim=1)
    weights = [(torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype) if norm else None
               for _ in range(2)]
    cos_sin = RotaryEmbedding(head_dim, MAX_POS, {"rope_type": "default", "rope_theta": 1e4}
                              ).to(DEVICE).cos_sin_cache
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref, _ = qk_norm_rope(q, k, positions, *weights, cos_sin, 1e-5,
                            (v, k_ref, v_ref, slots), scales)
    args = (tables, 0.3, num_splits, window, *scales)
    want = decode_attention_triton(q_ref, k_ref, v_ref, ctx, *args)
    got = decode_attention_triton(q, k_cache, v_cache, ctx, *args, new_token=NewToken(
        k, v, positions, slots, cos_sin, *weights, 1e-5))
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    if DEVICE == "cpu":  # the same bytes; a GPU may sum k's squares in another order
        assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
        assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    tol = 0.13 if fp8 else atol  # FP8: one e4m3 step is 1/8 relative
    for got_cache, want_cache in ((k_cache, k_ref), (v_cache, v_ref)):
        torch.testing.assert_close(got_cache.float(), want_cache.float(), atol=tol, rtol=tol)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))


def test_a_wrong_new_key_shows() -> None:
    """The new key weighs in the output: another k gives another result (the test can fail)."""
    qkv, k_cache, v_cache, tables, ctx, positions, slots = _case([3, 2], 2, 16, torch.float32,
                                                                  torch.float32)
    cos_sin = RotaryEmbedding(16, MAX_POS, {"rope_type": "default", "rope_theta": 1e4}
                              ).to(DEVICE).cos_sin_cache

    def run(qkv):
        q, k, v = qkv.split([2 * KV_HEADS, KV_HEADS, KV_HEADS], dim=1)
        return decode_attention_triton(q, k_cache.clone(), v_cache.clone(), ctx, tables, 0.3,
                                       new_token=NewToken(k, v, positions, slots, cos_sin,
                                                          None, None, 0.0))
    other = qkv.clone()
    other[:, 2 * KV_HEADS:3 * KV_HEADS] += 1  # another new key
    assert not torch.allclose(run(qkv), run(other), atol=1e-3)
