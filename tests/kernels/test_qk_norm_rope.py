"""Fused q/k RMSNorm + RoPE (Triton) vs the package's eager torch ops (TRITON_INTERPRET on CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.attention.qk_norm_rope import qk_norm_rope  # noqa: E402
from nanovllm.kernels.attention.store_kvcache import store_kvcache_torch  # noqa: E402
from nanovllm.layers.attention import Attention  # noqa: E402
from nanovllm.layers.backends import FastPath, TorchBackend, TritonBackend  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from nanovllm.utils.context import Context, forward_context  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_POS, EPS = 4096, 1e-6
ROPE = {"rope_type": "default", "rope_theta": 1e6}
# yarn scales cos and sin by its attention factor (~1.14 here): the kernel reads them as cached
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 1024}
# (atol, rtol). The Triton 3.8 interpreter truncates float32 -> bf16 (hardware rounds to
# nearest even), and the kernel rounds three times, so on CPU bf16 is off by a few ulps.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


def _qkv_views(num_tokens: int, heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the non-contiguous views the decoder takes of the fused qkv output."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    # Scale and shift per column so the rms differs from head to head.
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE) * 3
    qkv = (qkv + torch.randn(q_size + 2 * kv_size, device=DEVICE)).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    kv_shape = (-1, kv_heads, head_dim)
    return q.view(-1, heads, head_dim), k.view(kv_shape), v.view(kv_shape)


def _kv_cache(kv_heads: int, head_dim: int, dtype: torch.dtype, num_tokens: int):
    """Random caches [4 blocks, 8 slots, Hkv, D] and a slot mapping: distinct random slots
    across blocks, the last token a padding row (-1)."""
    k_cache = torch.randn(4, 8, kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(32, device=DEVICE)[:num_tokens]
    slots[-1] = -1
    return k_cache, v_cache, slots


def _norm(head_dim: int, dtype: torch.dtype) -> RMSNorm:
    """An RMSNorm with a random weight in the activation dtype (as the model builds it)."""
    norm = RMSNorm(head_dim, eps=EPS).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    return norm


def _reference(norm_q: RMSNorm, norm_k: RMSNorm, rope: RotaryEmbedding, positions, q, k):
    """The torch path, eager even on CUDA (rms_forward is the torch code; RoPE is plain torch)."""
    with torch.no_grad():
        q = norm_q.rms_forward(q)
        k = norm_k.rms_forward(k)
        return rope(positions, q, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2), (6, 3)])  # 6, 3: padded heads
@pytest.mark.parametrize("num_tokens,store", [(1, False), (19, False), (2, True), (19, True)])
def test_matches_torch(num_tokens: int, store: bool, heads: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> None:
    """Strided q/k/v views, GQA and MHA, random positions: equal to norm, norm, RoPE in torch;
    with store, the caches equal store_kvcache_torch's (padding slot skipped)."""
    torch.manual_seed(head_dim + num_tokens)
    q, k, v = _qkv_views(num_tokens, heads, kv_heads, head_dim, dtype)
    # Views into qkv rows (with one token torch reports a contiguous view, stride and all).
    assert k.storage_offset() == heads * head_dim
    assert num_tokens == 1 or q.stride(0) == k.stride(0) == (heads + 2 * kv_heads) * head_dim
    norm_q, norm_k = _norm(head_dim, dtype), _norm(head_dim, dtype)
    rope = RotaryEmbedding(head_dim, MAX_POS, ROPE).to(DEVICE)
    positions = torch.randint(0, MAX_POS, (num_tokens,), device=DEVICE)
    q_ref, k_ref = _reference(norm_q, norm_k, rope, positions, q, k)
    q_before, k_before = q.clone(), k.clone()
    kv_store = _kv_cache(kv_heads, head_dim, dtype, num_tokens) if store else None
    if store:
        k_ref_cache, v_ref_cache, slots = (t.clone() for t in kv_store)
        store_kvcache_torch(k_ref, v, k_ref_cache, v_ref_cache, slots)
        kv_store = (v, *kv_store)
    q_out, k_out = qk_norm_rope(q, k, positions, norm_q.weight, norm_k.weight,
                                rope.cos_sin_cache, EPS, kv_store)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert q_out.dtype == k_out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q_out, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_out, k_ref, atol=atol, rtol=rtol)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched
    if store:
        # The cache holds exactly k_out (the kernel's own rounding), v bit for bit.
        store_kvcache_torch(k_out, v, k_ref_cache, v_ref_cache, slots)
        assert torch.equal(kv_store[1], k_ref_cache) and torch.equal(kv_store[2], v_ref_cache)


def test_empty_batch() -> None:
    """Zero tokens: empty outputs, no launch."""
    q, k, v = _qkv_views(0, 4, 2, 16, torch.float32)
    rope = RotaryEmbedding(16, MAX_POS, ROPE).to(DEVICE)
    weight = torch.ones(16, device=DEVICE)
    positions = torch.empty(0, dtype=torch.int64, device=DEVICE)
    q_out, k_out = qk_norm_rope(q, k, positions, weight, weight, rope.cos_sin_cache, EPS)
    assert q_out.shape == (0, 4, 16) and k_out.shape == (0, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_norm_matches_torch(dtype: torch.dtype) -> None:
    """No weights: RoPE alone (Qwen2, Llama, Mistral), here from a yarn cache."""
    torch.manual_seed(1)
    q, k, v = _qkv_views(7, 4, 2, 32, dtype)
    rope = RotaryEmbedding(32, MAX_POS, YARN).to(DEVICE)
    positions = torch.randint(0, MAX_POS, (7,), device=DEVICE)
    with torch.no_grad():
        q_ref, k_ref = rope(positions, q, k)
    q_out, k_out = qk_norm_rope(q, k, positions, None, None, rope.cos_sin_cache, EPS)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q_out, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_out, k_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_layer_fused_path(qk_norm: bool) -> None:
    """The fused backend's rope_and_store (the layer's own weights, eps, cache, the step's slot
    mapping) matches the torch backend's, and writes K/V only once the cache exists."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, 512, ROPE)
    # eps large enough that a dropped or wrong eps shows
    attn = Attention(4, 32, 32 ** -0.5, 2, rope, 0.5 if qk_norm else None).to(DEVICE)
    if qk_norm:
        with torch.no_grad():
            attn.q_norm.weight.normal_(1.0, 0.5)
            attn.k_norm.weight.normal_(1.0, 0.5)
    q, k, v = _qkv_views(5, 4, 2, 32, torch.float32)
    positions = torch.randint(0, 512, (5,), device=DEVICE)
    k_cache, v_cache, slots = _kv_cache(2, 32, torch.float32, 5)
    with torch.no_grad(), forward_context(Context(slot_mapping=slots)):
        assert attn.kv_store_args(v) is None  # warm-up: no cache yet
        attn.k_cache, attn.v_cache = k_cache.clone(), v_cache.clone()
        q_ref, k_ref = TorchBackend().rope_and_store(attn, positions, q, k, v)
        ref_caches = attn.k_cache.clone(), attn.v_cache.clone()
        attn.k_cache, attn.v_cache = k_cache.clone(), v_cache.clone()
        fused = TritonBackend(FastPath(fused_ops=True))
        q_out, k_out = fused.rope_and_store(attn, positions, q, k, v)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attn.k_cache, ref_caches[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(attn.v_cache, ref_caches[1])
