"""Write new key/value rows into the paged KV cache (Triton kernel + torch reference); an FP8
cache is quantized on the way in (kernels.attention.kv_quant)."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE, quantize_kv_torch


@triton.jit
def _round_to_e4m3(x):
    """float32 x rounded to nearest even on e4m3's grid, in float32 arithmetic: the conversion
    that follows is then exact, the same bits on a GPU and under the interpreter (whose own
    float8 rounding drops the carry into the exponent)."""
    # e4m3 keeps 3 mantissa bits: its step at |x| is 2^(floor(log2|x|) - 3), and 2^-9 below
    # 2^-6 (subnormals). Powers of two are built from exponent bits, so scaling is exact.
    exp_bits = tl.maximum(x.to(tl.int32, bitcast=True) & 0x7F800000, (127 - 6) << 23)
    step = (exp_bits - (3 << 23)).to(tl.float32, bitcast=True)
    inv_step = ((254 << 23) - exp_bits + (3 << 23)).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding then subtracting it rounds |y| < 2^22 to integers
    rounded = ((tl.abs(x) * inv_step + magic) - magic) * step
    return tl.where(x < 0, -rounded, rounded)  # -0.0 stays -0.0, as in torch


@triton.jit
def quantize_kv(x, inv_scale, dtype, FP8: tl.constexpr):
    """x in the cache dtype: with FP8, x * (1 / scale) in float32 rounded to e4m3 and
    saturated to +-448 (kv_quant.quantize_kv_torch, bit for bit)."""
    if FP8:
        x = tl.clamp(_round_to_e4m3(x.to(tl.float32) * inv_scale), -448.0, 448.0)
    return x.to(dtype)


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride_n,
    key_stride_h,
    value_stride_n,
    value_stride_h,
    k_inv_scale,
    v_inv_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_dim] K and V rows to its slot."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # padding row (e.g. CUDA-graph filler): nothing to write
        return
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < NUM_KV_HEADS)[:, None]
    row64 = row.to(tl.int64)
    key = tl.load(
        key_ptr + row64 * key_stride_n + heads[:, None] * key_stride_h + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + row64 * value_stride_n + heads[:, None] * value_stride_h + dims[None, :],
        mask=mask,
    )
    # Cache is contiguous [num_slots, num_kv_heads, head_dim]; int64 since it can exceed 2^31.
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cache_offs, quantize_kv(key, k_inv_scale, dtype, FP8), mask=mask)
    tl.store(v_cache_ptr + cache_offs, quantize_kv(value, v_inv_scale, dtype, FP8), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store key/value [N, Hkv, D] into caches [num_blocks, block_size, Hkv, D]; slot<0 skips.
    An FP8 cache stores key / k_scale and value / v_scale."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.numel() == num_tokens
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[-2:] == (num_kv_heads, head_dim)
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        FP8=k_cache.dtype == FP8_DTYPE,
    )


def store_kvcache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch reference of `store_kvcache` (same signature and semantics)."""
    num_kv_heads, head_dim = key.shape[1:]
    valid = slot_mapping >= 0  # boolean indexing syncs, fine for the CPU path
    slots = slot_mapping[valid].long()
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = quantize_kv_torch(x[valid], scale, cache.dtype)
        if cache.dtype == FP8_DTYPE:  # index_copy_ has no float8 kernel on CPU: copy the bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, rows)

