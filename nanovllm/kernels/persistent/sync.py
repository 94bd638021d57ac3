"""Synchronisation and prefetch for persistent kernels (kernels.persistent.decode_layer)."""
import triton
import triton.language as tl

from nanovllm.kernels.pdl import prefetch_l2


@triton.jit
def split_item(item, n):
    """(item // n, item % n), written so that the interpreter takes a plain int item with a
    constexpr n (constexpr has no reflected %)."""
    q = item // n
    return q, item - q * n


@triton.jit
def grid_sync(bar_ptr, num_programs, POLL: tl.constexpr):
    """Every program's writes before it are visible to every program after it. The counter's
    sign bit flips once per barrier (program 0 adds 2^31 - (P - 1), the rest 1 each), so it
    needs no reset between barriers or launches (cooperative groups' grid sync). POLL 0: every
    thread polls with volatile loads; 1: one thread with atomics (one request a program, not a
    warp's)."""
    tl.debug_barrier()  # the whole program has written what it will
    inc = tl.where(tl.program_id(0) == 0, 2147483647 - num_programs + 2, 1)
    old = tl.atomic_add(bar_ptr, inc, sem="release", scope="gpu")
    cur = _poll(bar_ptr, POLL)
    while (cur ^ old) >= 0:
        cur = _poll(bar_ptr, POLL)
    # Every thread then fences (acquire): an unused atomic's result would be compiled away.
    tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [cur],
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _poll(bar_ptr, POLL: tl.constexpr):
    if POLL == 0:
        return tl.load(bar_ptr, volatile=True)
    else:
        return tl.atomic_add(bar_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def prefetch_share(w_ptr, numel, pid, P, ENABLED: tl.constexpr):
    """Ask L2 for this program's 1/P share of a weight's contiguous storage (numel elements),
    without waiting for it: which program asks for a line does not matter, only that one does."""
    if ENABLED:
        ELEM: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        LINE: tl.constexpr = 128 // ELEM  # elements of a 128-byte line
        lines = tl.cdiv(numel, LINE)
        share = tl.cdiv(lines, P)
        for line0 in range(pid * share, tl.minimum((pid + 1) * share, lines), 256):
            line = tl.minimum(line0 + tl.arange(0, 256), lines - 1).to(tl.int64)
            prefetch_l2((w_ptr + line * LINE).to(tl.int64))
