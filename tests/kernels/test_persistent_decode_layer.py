"""The persistent decode layer (kernels.persistent) against a torch decoder layer: output and
the K/V it writes, Qwen3 (q/k norm) and Llama (none), 1 to 16 tokens, any program count."""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny interpreter dots: see test_attention

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.kernels.attention.reference import decode_attention_torch  # noqa: E402
from nanovllm.kernels.persistent.decode_layer import (  # noqa: E402
    LayerWeights,
    PersistentDecodeLayer,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HQ, HKV, D, INTER = 256, 4, 2, 64, 384
BLOCK = 16


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.rms_forward."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def weights(norm: bool, dtype: torch.dtype, k_major: bool) -> LayerWeights:
    """Random weights; with k_major o and down stored [in, out] (RowParallelLinear's layout)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    def stored(w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous().t() if k_major else w

    return LayerWeights(
        input_norm=1 + rand(H, scale=0.3), qkv=rand((HQ + 2 * HKV) * D, H),
        q_norm=1 + rand(D, scale=0.3) if norm else None,
        k_norm=1 + rand(D, scale=0.3) if norm else None, o=stored(rand(H, HQ * D)),
        post_norm=1 + rand(H, scale=0.3), gate_up=rand(2 * INTER, H),
        down=stored(rand(H, INTER)), eps=1e-6)


def reference(x, w: LayerWeights, rope: RotaryEmbedding, pos, slots, ctx, tables, k_cache,
              v_cache, scale):
    """The per-kernel path's math in torch; writes the new K/V into the caches."""
    t = x.shape[0]
    qkv = rms(x, w.input_norm, w.eps) @ w.qkv.T
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)
    if w.q_norm is not None:
        q, k = rms(q, w.q_norm, w.eps), rms(k, w.k_norm, w.eps)
    q, k = rope(pos, q, k)
    k_cache.view(-1, HKV, D)[slots] = k
    v_cache.view(-1, HKV, D)[slots] = v
    attn = decode_attention_torch(q, k_cache, v_cache, ctx, tables, scale).view(t, HQ * D)
    resid2 = (x.float() + (attn @ w.o.T).float()).to(x.dtype)
    gate, up = (rms(resid2, w.post_norm, w.eps) @ w.gate_up.T).chunk(2, dim=-1)
    return (resid2.float() + ((F.silu(gate) * up) @ w.down.T).float()).to(x.dtype)


def case(num_tokens: int, dtype: torch.dtype, base: int = 6):
    """Inputs of one decode step: token i's sequence holds base - 1 + 23 i keys before it."""
    g = torch.Generator().manual_seed(num_tokens)
    ctx = torch.tensor([base + 23 * i for i in range(num_tokens)], dtype=torch.int32)
    pages = (ctx.max().item() + BLOCK - 1) // BLOCK
    tables = torch.randperm(num_tokens * pages, generator=g).view(num_tokens, pages).int()
    cache = torch.randn(2, num_tokens * pages, BLOCK, HKV, D, generator=g).to(dtype)
    pos = (ctx - 1).long()
    slots = (tables[torch.arange(num_tokens), pos // BLOCK].long() * BLOCK + pos % BLOCK)
    x = torch.randn(num_tokens, H, generator=g).to(dtype)
    on = [t.to(DEVICE) for t in (x, pos, slots, ctx, tables)]
    return on, cache.to(DEVICE)


@pytest.mark.parametrize("num_tokens,norm,k_major,programs,base", [
    (1, True, True, 3, 6), (5, False, False, 4, 6), (16, True, False, 2, 6),
    (2, True, True, 16, 300)])  # 4 attention splits, the new tokens in the third, one empty
def test_matches_the_torch_layer_and_writes_the_same_kv(num_tokens, norm, k_major, programs,
                                                        base):
    dtype = torch.float32
    w = weights(norm, dtype, k_major)
    rope = RotaryEmbedding(D, 512, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    (x, pos, slots, ctx, tables), cache = case(num_tokens, dtype, base)
    scale = D ** -0.5
    ref_cache = cache.clone()
    expected = reference(x, w, rope, pos, slots, ctx, tables, *ref_cache, scale)
    layer = PersistentDecodeLayer(HQ, HKV, D, H, INTER, dtype, x.device, programs=programs)
    if base == 300:
        assert layer.attention_splits(num_tokens, tables.shape[1] * BLOCK) == 4
    cos_sin = rope.cos_sin_cache.squeeze(1).contiguous()
    got = layer(x, w, cos_sin, pos, slots, ctx, tables, cache[0], cache[1], scale)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_bf16_on_every_sm_within_bf16_rounding_of_the_torch_layer(num_tokens):
    """One program an SM (the production launch), bf16: the K/V and output within a few bf16
    steps of torch's (rounding points differ: the norm is applied per tile)."""
    dtype = torch.bfloat16
    w = weights(True, dtype, True)
    rope = RotaryEmbedding(D, 512, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    (x, pos, slots, ctx, tables), cache = case(num_tokens, dtype)
    ref_cache = cache.clone()
    expected = reference(x, w, rope, pos, slots, ctx, tables, *ref_cache, D ** -0.5)
    layer = PersistentDecodeLayer(HQ, HKV, D, H, INTER, dtype, x.device)
    got = layer(x, w, rope.cos_sin_cache.squeeze(1).contiguous(), pos, slots, ctx, tables,
                cache[0], cache[1], D ** -0.5)
    for _ in range(3):  # the barrier counter carries over launches
        again = layer(x, w, rope.cos_sin_cache.squeeze(1).contiguous(), pos, slots, ctx,
                      tables, cache[0], cache[1], D ** -0.5)
        assert torch.equal(again, got)
    torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)


def test_splits_spread_items_over_programs_and_divide_k():
    layer = PersistentDecodeLayer(16, 8, 128, 1024, 3072, torch.bfloat16, DEVICE, programs=132)
    assert (layer.s1, layer.s3, layer.s5, layer.s6) == (2, 8, 1, 8)  # Qwen3-0.6B on an H200
    assert layer.attention_splits(1, 4096) == 17 and layer.attention_splits(16, 4096) == 2
    assert layer.attention_splits(1, 256) == 4  # >= 64 keys a split
