"""Fused sampling: per-row argmax(l / T + Gumbel) (argmax(l) if T = 0) in one pass (Triton)."""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# The interpreter has no libdevice fast_log2f: there the fast noise takes the accurate log2.
_HW_LOG = not triton.knobs.runtime.interpret
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2(x, HW_LOG: tl.constexpr):
    """log2(x): lg2.approx (one MUFU op) if HW_LOG, else the accurate tl.log2."""
    if HW_LOG:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _gumbel_log2(u, HW_LOG: tl.constexpr):
    """-log2(-log2 u): Gumbel noise -log(-log u) times log2(e), plus a constant."""
    # lg2.approx's error on [0.5, 2] is absolute (2**-22): relative to -log2 u it is up to
    # 1.4 / (j + 0.5) for the j-th largest u (j >= 0), the largest noises, which decide flat
    # races. So for 1 - u < 2**-6, -log2 u is a series in v = 1 - u (truncation < 2**-26
    # relative); for the other u the relative error of -log2 u, i.e. the noise's absolute
    # error, is < 2**-16.5 (~1e-5 nats); the outer log adds < 3e-6 nats.
    v = 1.0 - u  # exact: u is a multiple of 2**-24
    series = v * (_LOG2E + v * (_LOG2E / 2 + v * (_LOG2E / 3 + v * (_LOG2E / 4))))
    e = tl.where(v < 0.015625, series, -_log2(u, HW_LOG))
    return -_log2(e, HW_LOG)


@triton.jit(do_not_specialize=["seed"])  # a fresh seed each step must not recompile
def _race_kernel(logits_ptr, temp_ptr, best_val_ptr, best_idx_ptr, stride_row, vocab, seed,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, HW_LOG: tl.constexpr):
    """One program per (row, chunk): the chunk's best value and its lowest column."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    num_chunks = tl.num_programs(1)
    Q: tl.constexpr = BLOCK // 4
    temp = tl.load(temp_ptr + row)
    # T clamped as in the torch path; the race runs in log2 units (a positive scale and a
    # constant keep the argmax)
    inv_temp = 1.0 / tl.maximum(temp, 1e-5) * _LOG2E
    row64 = row.to(tl.int64)  # row * stride overflows int32 for large batches
    start = chunk * CHUNK
    lanes = tl.arange(0, Q)
    # A block is [Q, 4]: 4 adjacent columns per counter. Init to the chunk's first column, so
    # an all -inf chunk still names a valid one.
    best_val = tl.full([Q, 4], float("-inf"), tl.float32)
    best_idx = tl.full([Q, 4], 0, tl.int32) + start
    for off in range(start, start + CHUNK, BLOCK):
        cols = off + 4 * lanes[:, None] + tl.arange(0, 4)[None, :]
        x = tl.load(logits_ptr + row64 * stride_row + cols, mask=cols < vocab,
                    other=float("-inf")).to(tl.float32)
        if temp != 0:  # greedy rows skip the noise: value = l, an exact argmax
            # Philox is the costly part: one call gives 4 words, for the 4 columns of counter
            # row * (vocab / 4) + (column / 4), unique per (row, column) below 2**31 counters
            # (B x V < 8.6e9). int32, not int64: before Triton 3.4 an int64 counter selects
            # 64-bit Philox, whose uint64 words would break the 23-bit shift below.
            counter = row * num_chunks * (CHUNK // 4) + off // 4 + lanes
            r0, r1, r2, r3 = tl.randint4x(seed, counter)
            tl.static_assert(r0.dtype == tl.uint32)
            bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [Q, 4])
            # 23 bits: (k + 0.5) / 2**23 is exact in float32 and never 0 or 1, so the
            # Gumbel noise -log(-log u) is finite.
            u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
            x = x * inv_temp + _gumbel_log2(u, HW_LOG)
        # Strict >: a lane keeps its earlier (lower) column among ties.
        better = x > best_val
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, cols, best_idx)
    # Across lanes: the max value, then the lowest column holding it.
    top = tl.max(best_val)
    idx = tl.min(tl.where(best_val == top, best_idx, 2**31 - 1))
    tl.store(best_val_ptr + row64 * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row64 * num_chunks + chunk, idx.to(tl.int64))


def race_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int,
                chunk: int = 4096, block: int = 1024) -> torch.Tensor:
    """Token ids [B] int64: Gumbel-max draw from softmax(l / T) per row, argmax(l) if T = 0."""
    assert logits.dim() == 2 and temperatures.shape == logits.shape[:1]
    assert chunk % block == 0 and block & (block - 1) == 0 and block >= 4
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    num_chunks = triton.cdiv(vocab, chunk)
    best_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, num_chunks, dtype=torch.int64, device=logits.device)
    temperatures = temperatures.float().contiguous()
    _race_kernel[(batch, num_chunks)](logits, temperatures, best_val, best_idx, logits.stride(0),
                                      vocab, seed, CHUNK=chunk, BLOCK=block,
                                      HW_LOG=_HW_LOG)
    # Chunks are in vocab order and torch.argmax returns the first max: ties go to the lowest
    # index across chunks too.
    winner = best_val.argmax(dim=1, keepdim=True)
    return best_idx.gather(1, winner).squeeze(1)
