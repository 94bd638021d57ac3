"""Probe: a swap-AB, TMA-fed Triton GEMM for decode-sized x @ W^T, against cuBLAS.

    PYTHONPATH=. python -m benchmarks.tma_gemm [--batches 16 64 128 256]

The weight's rows fill the MMA's 64-row side and the few tokens its narrow side (out^T =
W @ x^T), both operands arrive by TMA through a multi-stage pipeline, one program per BN weight
rows (and BT tokens). Timed like gemm_layouts: one CUDA graph of 28 calls on 28 distinct
weights, us per call; each launch is checked against F.linear first."""

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.gemm_layouts import LAYERS, layer_shapes, random_bf16
from benchmarks.runs import graph_replay_us, time_launches
from benchmarks.shapes import SHAPES


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """One thread of the program asks the L2 for nbytes from ptr (a hint; no value)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _swap_ab_kernel(w_ptr, w_desc, x_desc, out_ptr, M, N, K, BN: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """out = x @ W.T; with PDL it waits for the previous kernel, then releases the next (after
    PREFETCH: its weight rows, BN * K contiguous elements, asked of the L2 first)."""
    pid_n, pid_t = tl.program_id(0), tl.program_id(1)
    if PREFETCH:
        if pid_t == 0:
            _prefetch_l2(w_ptr + pid_n.to(tl.int64) * BN * K, BN * K * 2)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BN, BT], tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        w = w_desc.load([pid_n * BN, k])
        x = x_desc.load([pid_t * BT, k])
        acc = tl.dot(w, x.T, acc)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_t = pid_t * BT + tl.arange(0, BT)
    dst = out_ptr + offs_t[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=offs_t[None, :] < M)


def swap_ab(x, w, out, bn, bt, bk, stages, warps):
    """fn() computing out = x @ w.T with the given launch."""
    m, k = x.shape
    n = w.shape[0]
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    x_desc = TensorDescriptor.from_tensor(x, [bt, bk])
    grid = (n // bn, triton.cdiv(m, bt))
    return lambda: _swap_ab_kernel[grid](w, w_desc, x_desc, out, m, n, k, BN=bn, BT=bt, BK=bk,
                                         STAGES=stages, num_warps=warps)


def launches(m: int):
    top = min(max(16, triton.next_power_of_2(m)), 256)
    bts = sorted({top, 64, 128} if m > 128 else {top, 64} if m > 64 else {top})
    return itertools.product((64, 128), bts, (64, 128), (3, 4, 6), (4, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--gemms", nargs="+", default=["qkv", "gate_up"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    shapes = layer_shapes(SHAPES["qwen3-0.6b"])
    print(f"{torch.cuda.get_device_name()}: us per call, cuBLAS / best swap-AB TMA launch "
          "(BN, BT, BK, stages, warps) / next two")
    for name in args.gemms:
        n, k = shapes[name]
        ws = [random_bf16(n, k) for _ in range(LAYERS)]
        for m in args.batches:
            x, out = random_bf16(m, k), torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            fn = lambda x=x, ws=ws: [F.linear(x, w) for w in ws]  # noqa: E731
            cublas = graph_replay_us(fn, args.reps, 1) / LAYERS
            fitting = [(bn, bt, bk, stages, warps) for bn, bt, bk, stages, warps in launches(m)
                       if bk * (bn + bt) * 2 * stages <= 200_000]
            timed = time_launches(
                fitting, lambda launch, x=x, ws=ws, out=out: [swap_ab(x, w, out, *launch)
                                                              for w in ws],
                lambda _, out=out, ref=ref: torch.allclose(out.float(), ref.float(), rtol=2e-2,
                                                           atol=2e-2), args.reps, LAYERS)
            for us, launch in timed:
                print(f"  {name} M={m} {us:.2f} {launch}")
            rest = "  ".join(f"{us:.2f} {launch}" for us, launch in timed[1:3])
            print(f"{name:7s} M={m:3d} {cublas:6.2f} / {timed[0][0]:6.2f} {timed[0][1]} / {rest}",
                  flush=True)


if __name__ == "__main__":
    main()
