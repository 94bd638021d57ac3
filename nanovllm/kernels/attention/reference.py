"""Plain-torch paged attention (reference for the Triton kernels and the CPU engine path).

sliding_window as in transformers: a query at position q sees key k iff k <= q and q - k < window.
Paged reads dequantize an FP8 cache with the layer's k_scale / v_scale (kernels.attention.kv_quant).
"""

import torch

from nanovllm.kernels.attention.kv_quant import FP8_DTYPE, dequantize_kv_torch

# Queries per chunk in prefill: bounds the [H, chunk, Lk] fp32 score matrix.
_QUERY_CHUNK = 1024


def _gather_paged(
    cache: torch.Tensor, block_row: torch.Tensor, start: int, end: int
) -> torch.Tensor:
    """Gather tokens start..end-1 of one sequence from a paged cache -> [end - start, Hkv, D]."""
    if cache.dtype == FP8_DTYPE:  # gathered as bytes: not every device has float8 indexing
        return _gather_paged(cache.view(torch.uint8), block_row, start, end).view(FP8_DTYPE)
    block_size = cache.shape[1]
    first, last = start // block_size, (end + block_size - 1) // block_size
    blocks = block_row[first:last].long()
    offset = first * block_size
    return cache[blocks].flatten(0, 1)[start - offset : end - offset]


def check_sliding_window(sliding_window: int | None) -> int:
    """Window as an int (None/0: none); as in transformers, query q sees key k iff q - k < it."""
    if sliding_window is None:
        return 0
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be None or >= 0 (0 = no window), "
                         f"got {sliding_window}")
    return sliding_window


def _window_start(first_q_pos: int, window: int) -> int:
    """First key position any query at or after first_q_pos can see (0 without a window)."""
    return max(0, first_q_pos - window + 1) if window else 0


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    k_start: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """GQA attention of q [Lq, H, D] at positions q_pos [Lq] over k, v [Lk, Hkv, D] at k_start..;
    query q sees key k iff k <= q and (window == 0 or q - k < window)."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Query head h uses kv head h // group: group query heads under their kv head and broadcast
    # (same result as repeat_interleave on k/v, without the copy).
    qf = q.float().reshape(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kf = k.float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, Lk, D]
    vf = v.float().permute(1, 0, 2).unsqueeze(1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [Hkv, G, Lq, Lk]
    k_pos = torch.arange(k.shape[0], device=q.device) + k_start
    hidden = k_pos[None, :] > q_pos[:, None]  # the future
    if window:  # and keys that slid out of the window
        hidden |= q_pos[:, None] - k_pos[None, :] >= window
    scores.masked_fill_(hidden, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [Hkv, G, Lq, D]
    return out.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim).to(q.dtype)


def prefill_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor | None,
    scale: float,
    max_seqlen_q: int | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal varlen attention; keys from dense k/v, or the paged cache when block_tables given
    (an FP8 cache dequantized with k_scale, v_scale)."""
    del max_seqlen_q  # accepted for signature parity with the Triton version
    window = check_sliding_window(sliding_window)
    out = torch.empty_like(q)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q_start, q_end = cu_q[b], cu_q[b + 1]
        len_q, len_k = q_end - q_start, cu_k[b + 1] - cu_k[b]
        if len_q == 0:
            continue
        # Keys from position `first` on: earlier ones are outside every query's window.
        first = _window_start(len_k - len_q, window)
        if block_tables is None:
            keys, values = k[cu_k[b] + first : cu_k[b + 1]], v[cu_k[b] + first : cu_k[b + 1]]
        else:
            keys = dequantize_kv_torch(_gather_paged(k_cache, block_tables[b], first, len_k),
                                       k_scale)
            values = dequantize_kv_torch(_gather_paged(v_cache, block_tables[b], first, len_k),
                                         v_scale)
        for c in range(0, len_q, _QUERY_CHUNK):
            c_end = min(c + _QUERY_CHUNK, len_q)
            # Query i sits at position len_k - len_q + i (a cached prefix precedes the new tokens).
            q_pos = torch.arange(c, c_end, device=q.device) + (len_k - len_q)
            kv_end = len_k - len_q + c_end  # later keys are all in the future for this chunk
            kv_start = _window_start(len_k - len_q + c, window)  # earlier keys slid out
            out[q_start + c : q_start + c_end] = _attend(
                q[q_start + c : q_start + c_end], keys[kv_start - first : kv_end - first],
                values[kv_start - first : kv_end - first], q_pos, scale, kv_start, window,
            )
    return out


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query per sequence (q [B, H, D]) over its context_lens[b] cached keys (an FP8 cache
    dequantized with k_scale, v_scale); 0 -> zeros."""
    del num_splits  # accepted for signature parity with the Triton version
    window = check_sliding_window(sliding_window)
    out = torch.zeros_like(q)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:  # CUDA-graph padding row
            continue
        # The query sits at position length - 1; keys before the window are never gathered.
        start = _window_start(length - 1, window)
        keys = dequantize_kv_torch(_gather_paged(k_cache, block_tables[b], start, length), k_scale)
        values = dequantize_kv_torch(_gather_paged(v_cache, block_tables[b], start, length),
                                     v_scale)
        q_pos = torch.full((1,), length - 1, device=q.device)
        out[b] = _attend(q[b : b + 1], keys, values, q_pos, scale, start, window)[0]
    return out
