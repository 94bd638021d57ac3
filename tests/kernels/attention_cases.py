"""Shared cases and helpers of the attention kernel tests (test_attention, test_attention_window):
random paged caches, cumulative lengths, tolerances; torch only, so a test module sets
TRITON_INTERPRET before it imports Triton."""
import itertools

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# (block_size, head_dim, group): the full grid on CUDA; under the (slow) interpreter a covering
# subset in which every block_size, head_dim and GQA ratio appears.
PAGED_CASES = (
    list(itertools.product([16, 32, 256], [32, 64, 128], [1, 2, 4])) if DEVICE == "cuda"
    else [(16, 32, 1), (16, 64, 2), (16, 128, 4), (32, 64, 4), (256, 32, 2), (256, 128, 1)]
)
KV_HEADS = 2
# (atol, rtol) Triton vs reference; float32 dots run in IEEE precision (dot_precision).
TOL = {torch.float32: (1e-4, 1e-4),
       torch.bfloat16: (3e-2, 3e-2)}


def paged_pairs(block_size: int) -> list[tuple[int, int]]:
    """Mixed (seqlen_q, seqlen_k) batch: prefix hits, page crossings, exact page multiples."""
    return [(3, 3), (20, 53), (1, 33), (24, 2 * block_size), (8, block_size + 44)]


def cu_lens(lens: list[int]) -> torch.Tensor:
    """Cumulative sequence lengths [B + 1], int32."""
    return torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)


def paged_cache(
    lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches (garbage everywhere) and block tables of shuffled ids, padded with -1."""
    num_blocks, tables = block_tables(lens, block_size, spare=3)
    shape = (num_blocks, block_size, KV_HEADS, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    return k_cache, v_cache, tables


def block_tables(lens: list[int], block_size: int, spare: int) -> tuple[int, torch.Tensor]:
    """(blocks in the pool, block tables [B, widest + 1]): shuffled ids over all the sequences'
    blocks and `spare` more never referenced, padded with -1."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + spare
    ids = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(lens), max(per_seq) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return num_blocks, tables.to(DEVICE)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def poison_before_window(cache: torch.Tensor, tables: torch.Tensor, lens: list[int],
                          first_visible: list[int]) -> None:
    """NaN in every cached key/value no query can see: reading one would show in the output."""
    bs = cache.shape[1]
    for b, (n, lo) in enumerate(zip(lens, first_visible, strict=True)):
        for p in range(min(lo, n)):
            cache[int(tables[b, p // bs]), p % bs] = float("nan")
