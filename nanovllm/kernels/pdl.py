"""Programmatic dependent launch (PDL, sm_90+) for the decode step's own kernels. A kernel
launched with it is scheduled while the kernel before it still runs: its programs start, wait
(gdc_wait) for the predecessor to finish and its writes to land, then at once let the next
PDL kernel be scheduled in turn. A kernel boundary then costs no launch and no ramp-up, only
the wait's release; CUDA graphs keep the relation as a programmatic edge. It pays only
between two such kernels: cuBLAS GEMMs never release their dependents early
(docs/design.md). A MoE layer's kernels as PDL launches took the Qwen3-30B-A3B batch-1
step from 4,236 to 4,146 us (H200, alternated x2, 2026-12-04).

Before its wait a program may read only what no kernel of a step writes, so that it overlaps
the kernel before: weights, scales and biases, the step's inputs (positions, slots, context
lengths, block tables), which the host copies before the step's first kernel (the GPU-side
carry writes input_ids only: runner.step_inputs), and in a decode step the KV cache's rows
before each sequence's new position. That holds while a decode step writes only its new
positions' rows, a block is hashed (shared) only once the step writing it was launched, and no
kernel copies or recycles cache blocks inside a step (engine.block_manager). A decode
projection's program thus asks L2 for its first weight tiles (prefetch_tile) or loads its
weight slice (the one-token GEMVs), and decode with the new token loads its first K/V tile
(kernels.attention.decode); tests/kernels/test_pdl.py lists the helpers allowed there."""
import functools

import torch
import triton
import triton.language as tl


@functools.cache
def enabled() -> bool:
    """PDL on a Hopper-or-newer GPU; never under the interpreter (CPU tests)."""
    return (not triton.knobs.runtime.interpret and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


def launch_options() -> dict:
    """Keyword arguments for a kernel launch: PDL and the kernel's USE_PDL switch."""
    return {"launch_pdl": True, "USE_PDL": True} if enabled() else {"USE_PDL": False}


def prefetches(block_t: int) -> bool:
    """Whether a decode projection's programs prefetch their first weight tiles before the
    PDL wait (prefetch_tile): under PDL, up to 16 tokens, where weights are all it reads."""
    return enabled() and block_t <= 16


@triton.jit
def wait_then_release(USE_PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible, then let the
    next PDL kernel start. Every program calls it unconditionally, before any read of what a
    kernel writes and before any store: a kernel's completion then implies its predecessors'
    (a chain of PDL kernels stays ordered)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


PREFETCH_STEPS = tl.constexpr(2)  # K steps of weight tiles a program asks L2 for before its wait


@triton.jit
def prefetch_lines(ptr, row0, col0, stride, row_end, col_end, ROWS: tl.constexpr,
                   ROW_BYTES: tl.constexpr, ELEM_BYTES: tl.constexpr):
    """Addresses (int64) of the 128-byte lines of rows row0:+ROWS, ROW_BYTES from column col0,
    of a row-major matrix, held below row_end and col_end (a split's or the matrix's end:
    a line past them is asked for again, never one outside the weight)."""
    LINES: tl.constexpr = ROW_BYTES // 128
    rows = tl.minimum(row0 + tl.arange(0, ROWS)[:, None], row_end - 1).to(tl.int64)
    cols = tl.minimum(col0 + tl.arange(0, LINES)[None, :] * (128 // ELEM_BYTES), col_end - 1)
    return (ptr + rows * stride + cols).to(tl.int64)


@triton.jit
def prefetch_tile(ptr, row0, col0, stride, row_end, col_end, ROWS: tl.constexpr,
                  ROW_BYTES: tl.constexpr, ELEM_BYTES: tl.constexpr, ENABLED: tl.constexpr):
    """Ask L2 for prefetch_lines's lines and wait for nothing. Called before wait_then_release
    with a weight (no kernel writes one): under PDL its first tiles then stream while the
    kernel before still runs."""
    if ENABLED:
        lines = prefetch_lines(ptr, row0, col0, stride, row_end, col_end, ROWS, ROW_BYTES,
                               ELEM_BYTES)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [lines], dtype=tl.int32, is_pure=False, pack=1)
