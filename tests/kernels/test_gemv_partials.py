"""One-token split-K partials (kernels.linear.gemv_partials) vs float32 torch
(TRITON_INTERPRET on CPU): 16-bit weights in both layouts, FP8 codes per channel, and a decode's
splits merged inside them (pending_merge.PendingMerge)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from nanovllm.kernels.attention.decode import decode_attention_triton  # noqa: E402
from nanovllm.kernels.attention.reference import decode_attention_torch  # noqa: E402
from nanovllm.kernels.linear.gemv_partials import (  # noqa: E402
    _partials_tiles,
    gemv_partials,
    runs_gemv,
    runs_merge_gemv,
)
from tests.kernels.gemv_cases import (  # noqa: E402
    DEVICE,
    DTYPES,
    gemv_weight,
    pending_merge,
    token_row,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["row-major", "k-major", "fp8"])
@pytest.mark.parametrize("rows,cols", [(128, 3072), (64, 1024), (256, 1536)])
def test_gemv_partials(dtype, fmt, rows, cols) -> None:
    """The partials sum to x @ W.T in float32; S is K over the tiles' K slice."""
    torch.manual_seed(rows + cols)
    weight, scales, w32 = gemv_weight(rows, cols, fmt, dtype)
    x = token_row(cols, dtype)
    assert runs_gemv(x, weight, scales)
    parts = gemv_partials(x, weight, scales)
    k_split = _partials_tiles(rows, cols, weight.element_size(), fmt == "k-major")[1]
    assert parts.dtype == torch.float32 and parts.shape == (cols // k_split, 1, rows)
    torch.testing.assert_close(parts.sum(0), x.float() @ w32.T, atol=1e-3, rtol=1e-3)
    if scales is not None:  # the scales are read per row: swapped rows must fail
        wrong = gemv_partials(x, weight, scales.flip(0).contiguous()).sum(0)
        assert not torch.allclose(wrong, x.float() @ w32.T, atol=1e-2, rtol=1e-2)


def _merged(part_m, part_l, part_acc, dtype: torch.dtype) -> torch.Tensor:
    """The splits' softmax partials [1, H, S(, D)] merged in float32 torch, then in dtype:
    [1, H * D]."""
    m_max = part_m.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    w = torch.exp2(part_m - m_max)
    denom = (w * part_l).sum(-1)
    o = (w[..., None] * part_acc).sum(-2) / torch.where(denom == 0, 1, denom)[..., None]
    return o.to(dtype).flatten(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,heads", [("k-major", 8), ("fp8", 4)])
@pytest.mark.parametrize("splits,empty", [(3, 0), (16, 5), (40, 7), (64, 0), (21, 21)])
def test_gemv_partials_merges_a_pending_decode(dtype, fmt, heads, splits, empty) -> None:
    """A PendingMerge's partials, merged inside the GEMV (chunks of 16 splits), give the GEMV of
    the merged output; empty splits (m = -inf) weigh nothing, and those past the last live one
    are never read. To one rounding of the output: the float32 sums' order is the kernel's
    own."""
    torch.manual_seed(splits + heads)
    head_dim, rows = 128, 64
    k = heads * head_dim  # 512-row K slices (16-bit k-major, FP8 [N, K] at K 512): 4 heads
    weight, scale, _ = gemv_weight(rows, k, fmt, dtype)
    assert runs_merge_gemv(dtype, head_dim, weight, scale)
    pending = pending_merge(1, heads, splits, empty, head_dim, dtype)
    part_m, part_l, part_acc = pending.part_m, pending.part_l, pending.part_acc
    merged = gemv_partials(pending, weight, scale)
    expected = gemv_partials(_merged(part_m, part_l, part_acc, dtype), weight, scale)
    torch.testing.assert_close(merged, expected, atol=2e-2, rtol=2e-2)
    assert merged.any() != (empty == splits)
    if empty:  # splits past the last live one (a short context's) are never read
        part_acc[:, :, splits - empty:] = float("nan")
        torch.testing.assert_close(gemv_partials(pending, weight, scale), merged, atol=0, rtol=0)
    if 0 < empty < splits:  # the heads in their order: swapped halves must fail
        swapped = _merged(part_m, part_l, part_acc, dtype).view(1, 2, -1).flip(1).flatten(1)
        assert not torch.allclose(merged, gemv_partials(swapped, weight, scale), atol=2e-2)


@pytest.mark.parametrize("ctx,window,splits", [(1, None, 16), (37, None, 16), (200, 45, 16),
                                               (600, None, 16), (1000, None, 40)])
def test_gemv_partials_merges_the_splits_its_context_fills(ctx, window, splits) -> None:
    """A lone token's decode left unmerged, with its context lengths: the GEMV counts the splits
    holding a key from them, before its wait, and merges only those (the rest poisoned with
    NaN change nothing) into the GEMV of the reference attention's output; past 16 live
    splits, chunk by chunk."""
    torch.manual_seed(ctx)
    block_size, kv_heads, heads, head_dim = 32, 2, 4, 128
    blocks = -(-ctx // block_size)
    table = torch.randperm(blocks + 2, device=DEVICE)[:blocks].to(torch.int32)[None]
    cache = [torch.randn(blocks + 2, block_size, kv_heads, head_dim, device=DEVICE)
             for _ in range(2)]
    q = torch.randn(1, heads, head_dim, device=DEVICE)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEVICE)
    pending = decode_attention_triton(q, *cache, lens, table, 0.1, num_splits=splits,
                                      sliding_window=window, defer_merge=True)
    live = int((pending.part_m[0, 0] > float("-inf")).sum())
    assert pending.context_lens is lens and 1 <= live < splits
    pending.part_acc[:, :, live:] = float("nan")
    weight, _, _ = gemv_weight(64, heads * head_dim, "k-major", torch.float32)
    reference = decode_attention_torch(q, *cache, lens, table, 0.1, sliding_window=window)
    torch.testing.assert_close(gemv_partials(pending, weight),
                               gemv_partials(reference.flatten(1), weight), atol=1e-4, rtol=1e-4)


def test_merge_only_where_programs_take_whole_heads() -> None:
    """runs_merge_gemv: a GEMV weight whose programs' K slices hold whole heads, at most 4."""
    weight, _, _ = gemv_weight(64, 4096, "k-major", torch.bfloat16)  # 512-row K slices
    assert runs_merge_gemv(torch.bfloat16, 128, weight)
    assert not runs_merge_gemv(torch.bfloat16, 96, weight)  # not whole heads
    assert not runs_merge_gemv(torch.bfloat16, 64, weight)  # 8 heads a program
    assert not runs_merge_gemv(torch.float16, 128, weight)  # activations of another dtype
    codes, scale, _ = gemv_weight(64, 4096, "fp8", torch.bfloat16)  # [N, K]: 2,048 columns
    assert runs_gemv(token_row(4096, torch.bfloat16), codes, scale)
    assert not runs_merge_gemv(torch.bfloat16, 128, codes, scale)
