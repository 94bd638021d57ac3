"""Synchronisation and prefetch for persistent kernels (kernels.persistent.decode_layer)."""
import triton
import triton.language as tl

BN = tl.constexpr(64)  # output rows (weight rows) a GEMM item computes


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
def prefetch_items(w_ptr, s_n, s_k, pid, P, NT, S, K_LEN, BK: tl.constexpr,
                    K_CONTIG: tl.constexpr):
    """Ask L2 for the weight tiles of this program's items (split_item(item, NT): its K split and
    64-row tile) without waiting for them."""
    for item in range(pid, S * NT, P):
        split, tile = split_item(item, NT)
        n0 = tile * BN
        for k in range(split * K_LEN, (split + 1) * K_LEN, BK):
            if K_CONTIG:  # [N, K] rows: two 128-byte lines a row of 128 bf16
                offs = (n0 + tl.arange(0, BN))[:, None] * s_n + k + \
                    tl.arange(0, BK // 64)[None, :] * 64
            else:  # [K, N] rows: 64 bf16 of a row are one line
                offs = n0 + (k + tl.arange(0, BK)) * s_k
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [(w_ptr + offs).to(tl.int64)], dtype=tl.int32,
                                      is_pure=False, pack=1)
