"""FP8 KV cache: the Triton writers quantize and the Triton readers dequantize exactly as the torch
reference does (TRITON_INTERPRET on CPU), with non-unit per-layer scales."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.attention.decode import (  # noqa: E402
    _PAGES_PER_CHUNK,
    decode_attention_triton,
)
from nanovllm.kernels.attention.kv_quant import FP8_DTYPE, FP8_MAX, quantize_kv_torch  # noqa: E402
from nanovllm.kernels.attention.prefill import prefill_attention_triton  # noqa: E402
from nanovllm.kernels.attention.qk_norm_rope import qk_norm_rope  # noqa: E402
from nanovllm.kernels.attention.reference import (  # noqa: E402
    decode_attention_torch,
    prefill_attention_torch,
)
from nanovllm.kernels.attention.store_kvcache import store_kvcache, store_kvcache_torch  # noqa: E402
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from tests.kernels.attention_cases import block_tables  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS = 2
K_SCALE, V_SCALE = 0.05, 0.3  # non-unit, and different for K and V
# (block_size, head_dim, group): under the interpreter a few cases covering GQA and page sizes
CASES = [(16, 32, 2), (32, 64, 1), (256, 32, 4)]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _zeros(shape: tuple[int, ...]) -> torch.Tensor:
    """A zeroed FP8 tensor (filled as bytes: float8 fill is not on every device)."""
    return torch.zeros(shape, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)


def _slots(num_tokens: int, num_slots: int) -> torch.Tensor:
    slots = torch.randperm(num_slots, device=DEVICE)[:num_tokens].to(torch.int32)
    slots[::5] = -1  # padding rows write nothing
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_fp8_matches_torch(dtype: torch.dtype) -> None:
    """Triton store == torch store byte for byte; values past +-448 * scale saturate; in range
    the dequantized cache is within e4m3's half-ulp (2^-4 relative) of the input."""
    num_tokens, head_dim, block_size = 30, 32, 16
    key = (torch.randn(num_tokens, KV_HEADS, head_dim, device=DEVICE) * 8).to(dtype)
    value = (torch.randn(num_tokens, KV_HEADS, head_dim, device=DEVICE) * 40).to(dtype)
    key[1, 0, 0], value[2, 1, 3] = 1e4, -1e4  # beyond 448 * scale
    slots = _slots(num_tokens, 4 * block_size)
    shape = (4, block_size, KV_HEADS, head_dim)
    k_cache, v_cache, k_ref, v_ref = (_zeros(shape) for _ in range(4))
    store_kvcache(key, value, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    store_kvcache_torch(key, value, k_ref, v_ref, slots, K_SCALE, V_SCALE)
    assert torch.equal(_bytes(k_cache), _bytes(k_ref)) and torch.equal(_bytes(v_cache),
                                                                       _bytes(v_ref))
    valid = slots >= 0
    rows = slots[valid].long()
    stored_k, stored_v = (_bytes(c).view(-1, KV_HEADS, head_dim)[rows].view(FP8_DTYPE).float()
                          for c in (k_cache, v_cache))
    assert stored_k[0, 0, 0] == FP8_MAX  # key row 1 is valid row 0 (row 0 is padding)
    assert stored_v[1, 1, 3] == -FP8_MAX
    for stored, x, scale in ((stored_k, key, K_SCALE), (stored_v, value, V_SCALE)):
        x = x[valid].float()
        normal = (x.abs() >= 2**-6 * scale) & (x.abs() <= FP8_MAX * scale)
        err = (stored * scale - x).abs()[normal] / x.abs()[normal]
        assert err.max() <= 2**-4 and err.mean() < 2**-5


def test_qk_norm_rope_fp8_store_matches_torch() -> None:
    """The fused kernel's FP8 write == store_kvcache_torch of its own rotated k, byte for byte."""
    num_tokens, heads, head_dim, block_size = 12, 4, 32, 16
    q = torch.randn(num_tokens, heads, head_dim, device=DEVICE)
    k = torch.randn(num_tokens, KV_HEADS, head_dim, device=DEVICE) * 5
    v = torch.randn(num_tokens, KV_HEADS, head_dim, device=DEVICE) * 20
    rope = RotaryEmbedding(head_dim, 1024, {"rope_type": "default", "rope_theta": 1e6}).to(DEVICE)
    positions = torch.randint(0, 1024, (num_tokens,), device=DEVICE)
    weight = torch.rand(head_dim, device=DEVICE) + 0.5
    slots = _slots(num_tokens, 2 * block_size)
    shape = (2, block_size, KV_HEADS, head_dim)
    k_cache, v_cache, k_ref, v_ref = (_zeros(shape) for _ in range(4))
    _, k_out = qk_norm_rope(q, k, positions, weight, weight.clone(), rope.cos_sin_cache, 1e-6,
                            (v, k_cache, v_cache, slots), (K_SCALE, V_SCALE))
    store_kvcache_torch(k_out, v, k_ref, v_ref, slots, K_SCALE, V_SCALE)
    assert torch.equal(_bytes(k_cache), _bytes(k_ref)) and torch.equal(_bytes(v_cache),
                                                                       _bytes(v_ref))
    assert _bytes(k_cache).any()  # something was written


def _fp8_cache(lens: list[int], block_size: int, head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantized random caches (values spread over e4m3's range at K_SCALE, V_SCALE) and block
    tables of shuffled ids, padded with -1."""
    num_blocks, tables = block_tables(lens, block_size, spare=2)
    shape = (num_blocks, block_size, KV_HEADS, head_dim)
    k = quantize_kv_torch(torch.randn(shape, device=DEVICE) * 3, K_SCALE, FP8_DTYPE)
    v = quantize_kv_torch(torch.randn(shape, device=DEVICE) * 30, V_SCALE, FP8_DTYPE)
    return k, v, tables


def _naive_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, length: int, q_pos: list[int], scale: float) -> torch.Tensor:
    """float64 causal attention of q [Lq, H, D] over one sequence's dequantized cache."""
    bs, group = k_cache.shape[1], q.shape[1] // KV_HEADS
    rows = [(int(table[p // bs]), p % bs) for p in range(length)]
    keys = torch.stack([k_cache[b, o] for b, o in rows]).double() * K_SCALE
    values = torch.stack([v_cache[b, o] for b, o in rows]).double() * V_SCALE
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_pos):
        for h in range(q.shape[1]):
            p = torch.softmax(keys[: pos + 1, h // group] @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ values[: pos + 1, h // group]
    return out


def test_torch_reference_dequantizes() -> None:
    """The torch readers of an FP8 cache == float64 attention over cache * scale."""
    block_size, head_dim, pairs = 16, 16, [(20, 53), (1, 17), (16, 16)]
    k_lens = [p[1] for p in pairs]
    k_cache, v_cache, tables = _fp8_cache(k_lens, block_size, head_dim)
    q = torch.randn(sum(p[0] for p in pairs), 2 * KV_HEADS, head_dim, device=DEVICE)
    cu_q = torch.tensor([0, *[p[0] for p in pairs]], device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens], device=DEVICE).cumsum(0).to(torch.int32)
    out = prefill_attention_torch(q, None, None, k_cache, v_cache, cu_q, cu_k, tables, 0.3,
                                  k_scale=K_SCALE, v_scale=V_SCALE)
    for b, (len_q, len_k) in enumerate(pairs):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        expected = _naive_paged(q[rows].cpu(), k_cache.cpu(), v_cache.cpu(), tables[b].cpu(),
                                len_k, list(range(len_k - len_q, len_k)), 0.3)
        torch.testing.assert_close(out[rows].double().cpu(), expected, atol=1e-5, rtol=1e-5)
    ctx = torch.tensor(k_lens, dtype=torch.int32, device=DEVICE)
    dec = decode_attention_torch(q[:3], k_cache, v_cache, ctx, tables, 0.3,
                                 k_scale=K_SCALE, v_scale=V_SCALE)
    for b, n in enumerate(k_lens):
        expected = _naive_paged(q[b : b + 1].cpu(), k_cache.cpu(), v_cache.cpu(),
                                tables[b].cpu(), n, [n - 1], 0.3)
        torch.testing.assert_close(dec[b : b + 1].double().cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("block_size", "head_dim", "group"), CASES)
def test_prefill_triton_fp8_cached_prefix(block_size: int, head_dim: int, group: int) -> None:
    """Paged prefill over an FP8 cache (cached prefixes, page crossings) == the torch reference."""
    pairs = [(3, 3), (20, 53), (1, 33), (8, block_size + 44)]
    q_lens, k_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    k_cache, v_cache, tables = _fp8_cache(k_lens, block_size, head_dim)
    q = torch.randn(sum(q_lens), group * KV_HEADS, head_dim, device=DEVICE)
    cu_q = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens], device=DEVICE).cumsum(0).to(torch.int32)
    args = (q, None, None, k_cache, v_cache, cu_q, cu_k, tables, head_dim**-0.5)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    out = prefill_attention_triton(*args, max_seqlen_q=max(q_lens), **scales)
    torch.testing.assert_close(out, prefill_attention_torch(*args, **scales), atol=1e-4,
                               rtol=1e-4)
    # The scales are really applied: unit scales give a different answer.
    assert not torch.allclose(out, prefill_attention_triton(*args), atol=1e-2)


@pytest.mark.parametrize(("block_size", "head_dim", "group"), CASES)
def test_decode_triton_fp8(block_size: int, head_dim: int, group: int) -> None:
    """Split-KV decode over an FP8 cache (incl. several splits, a padding row) == reference."""
    lens = [1, 45, 2 * block_size + 3, 600, 0]
    k_cache, v_cache, tables = _fp8_cache(lens, block_size, head_dim)
    q = torch.randn(len(lens), group * KV_HEADS, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    out = decode_attention_triton(q, k_cache, v_cache, ctx, tables, head_dim**-0.5, **scales)
    ref = decode_attention_torch(q, k_cache, v_cache, ctx, tables, head_dim**-0.5, **scales)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize(("num_splits", "window"), [(1, None), (2, None), (1, 300), (2, 519)])
def test_decode_triton_fp8_page_chunks(num_splits: int, window: int | None) -> None:
    """FP8 decode (its own pipelined launch) with splits and windows longer than a chunk of
    block-table entries (16-key pages) == reference."""
    block_size, head_dim = 16, 16
    lens = [2 * _PAGES_PER_CHUNK * block_size + 21, _PAGES_PER_CHUNK * block_size, 7, 0]
    k_cache, v_cache, tables = _fp8_cache(lens, block_size, head_dim)
    q = torch.randn(len(lens), 2 * KV_HEADS, head_dim, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, ctx, tables, head_dim**-0.5)
    kwargs = dict(k_scale=K_SCALE, v_scale=V_SCALE, sliding_window=window)
    out = decode_attention_triton(*args, num_splits=num_splits, **kwargs)
    torch.testing.assert_close(out, decode_attention_torch(*args, **kwargs), atol=1e-4, rtol=1e-4)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
