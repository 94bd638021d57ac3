"""The fused decode projections with a LoRA delta (one more K step) vs the unfused projection
plus kernels.linear.lora_reference's expand (TRITON_INTERPRET on CPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanovllm.kernels.fused_ops import (  # noqa: E402
    add_partials_rms_norm,
    add_rms_norm,
    rms_norm,
)
from nanovllm.kernels.linear.fused import qkv_rope_store  # noqa: E402
from nanovllm.kernels.linear.fused_gate_up import gate_up_silu  # noqa: E402
from nanovllm.kernels.linear.lora import LoRASlots, fits_lora, lora_ahead_buffers  # noqa: E402
from nanovllm.kernels.linear.lora_reference import lora_expand, lora_shrink_torch  # noqa: E402
from nanovllm.kernels.linear.split_k import split_k_linear  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN = 256
# The interpreter's TMA loads garble bf16 (numpy has none): bf16 runs on CUDA only.
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs sm_90")


def _lora(num_tokens: int, k: int, slice_sizes: tuple[int, ...], max_loras: int, rank: int,
          dtype: torch.dtype, x: torch.Tensor, rows: str = "mixed"
          ) -> tuple[LoRASlots, torch.Tensor]:
    """(the kernels' LoRASlots, the reference's shrunk rows) for slots of `rows`: "mixed"
    (random, base rows among them), "one" (the last slot and base rows, as a lone sequence's
    step) or "none" (a LoRA engine's step of base rows only)."""
    g = torch.Generator().manual_seed(num_tokens)
    a = (torch.randn(len(slice_sizes), max_loras, rank, k, generator=g) * k ** -0.5)
    b = torch.randn(sum(slice_sizes), max_loras, rank, generator=g) * 0.3
    slots = torch.randint(-1, max_loras, (num_tokens,), generator=g, dtype=torch.int32)
    if rows != "mixed":
        slots = torch.where(slots >= 0, max_loras - 1 if rows == "one" else -1, -1)
        slots[0] = max_loras - 1 if rows == "one" else -1
    a, b, slots = a.to(DEVICE, dtype), b.to(DEVICE, dtype), slots.to(DEVICE)
    return LoRASlots(a, b, slots), lora_shrink_torch(x, a, slots)


def _x(num_tokens: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(num_tokens, k, device=DEVICE).to(dtype)


def test_fits_lora():
    assert fits_lora(4, 16) and fits_lora(2, 8) and fits_lora(1, 8)
    assert not fits_lora(8, 16) and not fits_lora(3, 4) and not fits_lora(1, 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,max_loras,rank,rows", [
    (5, 4, 16, "mixed"), (37, 2, 8, "mixed"), (130, 4, 16, "mixed"), (1, 4, 16, "one"),
    (37, 2, 8, "one"), (130, 4, 16, "one"), (5, 4, 16, "none")])
def test_gate_up_silu_with_lora(dtype, num_tokens, max_loras, rank, rows):
    inter = 128
    weight = (torch.randn(2 * inter, HIDDEN, device=DEVICE) * HIDDEN ** -0.5).to(dtype)
    x = _x(num_tokens, HIDDEN, dtype)
    lora, shrunk = _lora(num_tokens, HIDDEN, (inter, inter), max_loras, rank, dtype, x, rows)
    y = F.linear(x.float(), weight.float())
    want = SiluAndMul.torch_forward(lora_expand(y, shrunk.float(), lora.lora_b.float(),
                                                (inter, inter)))
    got = gate_up_silu(x, weight, None, lora=lora)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    without = gate_up_silu(x, weight, None)
    _has_delta(got, without, rows)


def _has_delta(got: torch.Tensor, without: torch.Tensor, rows: str) -> None:
    """The delta is there (the checks have teeth), or exactly absent with no adapter."""
    if rows == "none":
        torch.testing.assert_close(got, without, atol=0, rtol=0)
    else:
        assert (got - without).abs().max() > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,input_size,max_loras,rank,rows", [
    (5, 1024, 4, 16, "mixed"), (40, 512, 2, 8, "mixed"), (200, 1024, 4, 16, "mixed"),
    (1, 1024, 4, 16, "one"), (40, 512, 2, 8, "one"), (200, 1024, 4, 16, "one"),
    (5, 1024, 4, 16, "none")])
def test_split_k_with_lora(dtype, num_tokens, input_size, max_loras, rank, rows):
    output = 128
    w_kn = (torch.randn(input_size, output, device=DEVICE) * input_size ** -0.5).to(dtype)
    weight = w_kn.t()
    x = _x(num_tokens, input_size, dtype)
    lora, shrunk = _lora(num_tokens, input_size, (output,), max_loras, rank, dtype, x, rows)
    parts = split_k_linear(x, weight, lora=lora)
    plain = split_k_linear(x, weight)
    # several splits: per-split deltas (one token without LoRA runs the GEMV's own splits)
    assert parts.shape[1:] == plain.shape[1:] and parts.shape[0] > 1
    want = lora_expand(F.linear(x.float(), weight.float()), shrunk.float(), lora.lora_b.float(),
                       (output,))
    # each split's part of the shrink is rounded to the model dtype
    torch.testing.assert_close(parts.sum(0), want, atol=2e-2, rtol=2e-2)
    _has_delta(parts.sum(0), plain.sum(0), rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,max_loras,rank,rows", [
    (3, 4, 16, "mixed"), (37, 2, 8, "mixed"), (130, 4, 16, "mixed"), (2, 4, 16, "one"),
    (37, 2, 8, "one"), (3, 4, 16, "none")])
def test_qkv_rope_store_with_lora(dtype, num_tokens, max_loras, rank, rows):
    """q and the cached k, v equal the unfused qkv_proj + delta, then RoPE, for each slice."""
    heads, kv_heads, head_dim = 2, 1, 128
    sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    weight = (torch.randn(sum(sizes), HIDDEN, device=DEVICE) * HIDDEN ** -0.5).to(dtype)
    x = _x(num_tokens, HIDDEN, dtype)
    lora, shrunk = _lora(num_tokens, HIDDEN, sizes, max_loras, rank, dtype, x, rows)
    rope = RotaryEmbedding(head_dim, 512, {"rope_type": "default", "rope_theta": 1e6}).to(DEVICE)
    positions = torch.randint(0, 512, (num_tokens,), device=DEVICE)
    k_cache = torch.zeros(16, 16, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(256, device=DEVICE)[:num_tokens]
    qkv = lora_expand(F.linear(x.float(), weight.float()), shrunk.float(), lora.lora_b.float(),
                      sizes)
    q, k, v = (t.to(dtype) for t in qkv.split(sizes, -1))
    q_ref, k_ref = rope(positions, q.reshape(-1, heads, head_dim),
                        k.reshape(-1, kv_heads, head_dim))
    q_out = qkv_rope_store(x, weight, None, heads, kv_heads, positions, None, None, 0.0,
                           rope.cos_sin_cache, k_cache, v_cache, slots, lora=lora)
    tol = dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(q_out.float(), q_ref.float(), **tol)
    flat_k, flat_v = k_cache.view(256, kv_heads, head_dim), v_cache.view(256, kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots].float(), k_ref.float(), **tol)
    torch.testing.assert_close(flat_v[slots].float(), v.reshape(-1, kv_heads, head_dim).float(),
                               **tol)


def _norm(kind: str, x: torch.Tensor, weight: torch.Tensor, lora=None):
    """(normed, residual out or None) of fused_ops' norm `kind` over x's rows, lora's buffers
    filled too: "rms" (x alone), "add" (x + a residual), "partials" (3 split-K partials)."""
    g = torch.Generator().manual_seed(x.shape[0])
    residual = (torch.randn(x.shape, generator=g) * 2).to(DEVICE, x.dtype)
    if kind == "rms":
        return rms_norm(x, weight, 1e-6, lora), None
    if kind == "add":
        return add_rms_norm(x, residual, weight, 1e-6, lora)
    parts = torch.stack([x.float() / 3] * 3).contiguous()
    return add_partials_rms_norm(parts, residual, weight, 1e-6, lora)


def _projection(slice_sizes: tuple[int, ...], x: torch.Tensor):
    """A function running gate_up_silu (two slices) or qkv_rope_store (three: 2 q heads, 1 kv
    head) on x with given LoRA slots."""
    weight = (torch.randn(sum(slice_sizes), x.shape[1], device=DEVICE) * x.shape[1] ** -0.5
              ).to(x.dtype)
    if len(slice_sizes) == 2:
        return lambda lora, **kw: gate_up_silu(x, weight, None, lora=lora, **kw)
    rope = RotaryEmbedding(128, 64, {"rope_type": "default", "rope_theta": 1e4}).to(DEVICE)
    cache = torch.zeros(16, 16, 1, 128, device=DEVICE, dtype=x.dtype)
    positions = torch.arange(x.shape[0], device=DEVICE)
    return lambda lora, **kw: qkv_rope_store(x, weight, None, 2, 1, positions, None, None, 0.0,
                                             rope.cos_sin_cache, cache, cache.clone(),
                                             positions, lora=lora, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "add", "partials"])
@pytest.mark.parametrize("num_tokens,hidden,max_loras,rank,rows", [
    (1, 256, 4, 16, "one"), (5, 256, 4, 16, "mixed"), (16, 320, 2, 8, "mixed"),
    (3, 256, 4, 16, "none"), (2, 2560, 1, 8, "one")])
def test_shrink_ahead_from_the_norm(dtype, kind, num_tokens, hidden, max_loras, rank, rows):
    """The RMSNorm's shrink chunks (kernels.linear.lora.shrink_chunk) read by gate_up_silu and
    qkv_rope_store give their in-loop shrink's result, and the norm's own outputs unchanged:
    320, a hidden size that is not a power of two, its last chunk partial; 2,560 in 5 chunks
    of 512. The buffers start as NaN: the chunks of rows without an adapter are never read."""
    x = _x(num_tokens, hidden, dtype)
    norm_w = (1 + 0.2 * torch.randn(hidden, device=DEVICE)).to(dtype)
    plain = _norm(kind, x, norm_w)
    for slice_sizes in ((128, 128), (256, 128, 128)):
        lora, _ = _lora(num_tokens, hidden, slice_sizes, max_loras, rank, dtype, x, rows)
        ahead = lora_ahead_buffers(lora.lora_a, lora.slots)
        assert ahead.parts.shape[0] == {256: 2, 320: 3, 2560: 5}[hidden]
        ahead.parts.fill_(float("nan"))
        ahead.rstd.fill_(float("nan"))
        normed, res_out = _norm(kind, x, norm_w, ahead)
        torch.testing.assert_close(normed, plain[0], atol=0, rtol=0)
        if res_out is not None:
            torch.testing.assert_close(res_out, plain[1], atol=0, rtol=0)
        run = _projection(slice_sizes, normed)
        got, in_loop = run(lora, ahead=ahead).float(), run(lora).float()
        # in bf16 the in-loop shrink reads the normed rows rounded, the norm's chunks do not
        torch.testing.assert_close(got, in_loop, rtol=2e-2,
                                   atol=2e-2 * max(1.0, in_loop.abs().max().item()))
        without = run(lora._replace(lora_a=torch.zeros_like(lora.lora_a)))
        _has_delta(got, without.float(), rows)
