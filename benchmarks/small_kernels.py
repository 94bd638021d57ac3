"""The decode step's small Triton kernels on CUDA, per launch, across launch parameters.

    PYTHONPATH=. python -m benchmarks.small_kernels [--batches 16 64 256] [--reps 30]

Each figure is one CUDA graph of 28 back-to-back launches (a layer's worth in a step), per
launch, median over replays: RMSNorm with the residual add, SiLU-and-mul, q/k norm + RoPE +
K/V write, Qwen3-0.6B shapes in bf16, at each num_warps (and SiLU tile width)."""

import argparse
from functools import partial

import torch
import triton

from benchmarks.runs import graph_replay_us
from nanovllm.kernels import fused_ops, qk_norm_rope

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, CALLS = 1024, 3072, 16, 8, 128, 28


def rms(x, res, w, out, res_out, warps):
    fused_ops._rms_norm_kernel[(x.shape[0],)](
        x, res, w, out, res_out, x.stride(0), res.stride(0), 1e-6, H=HIDDEN, BLOCK=HIDDEN,
        ADD=True, num_warps=warps)


def silu(x, out, block, warps):
    fused_ops._silu_and_mul_kernel[(x.shape[0], triton.cdiv(INTER, block))](
        x, out, x.stride(0), D=INTER, BLOCK=block, num_warps=warps)


def qk(q, k, v, qo, ko, w, pos, cache, kc, slots, warps):
    qk_norm_rope._qk_norm_rope_kernel[(q.shape[0],)](
        q, k, qo, ko, w, w, pos, cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cache.stride(0), 1e-6, v, v.stride(0), v.stride(1), kc, kc, slots, 1.0, 1.0,
        NUM_Q_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS, Q_HEADS_P2=HEADS, KV_HEADS_P2=KV_HEADS,
        HEAD_DIM=HEAD_DIM, STORE_KV=True, NORM=True, FP8=False, num_warps=warps)


def sweep(label: str, fn, options: dict, reps: int) -> None:
    """One line: us per launch of fn(*option) for each named option."""
    times = (f"{name} {graph_replay_us(partial(fn, *opt), reps, CALLS):5.2f}"
             for name, opt in options.items())
    print("  ".join([label, *times]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: us per launch (graph of {CALLS} launches)")
    warps = {f"w{w}": (w,) for w in (1, 2, 4, 8)}
    for b in args.batches:
        new = partial(torch.randn, device="cuda", dtype=torch.bfloat16)
        x, res, w = new(b, HIDDEN), new(b, HIDDEN), new(HIDDEN)
        sweep(f"B={b:3d} rms+add", partial(rms, x, res, w, torch.empty_like(x),
                                           torch.empty_like(x)), warps, args.reps)
        tiles = {f"t{t}w{w}": (t, w) for t in (512, 1024, 4096) for w in (2, 4, 8)}
        sweep(f"B={b:3d} silu", partial(silu, new(b, 2 * INTER), new(b, INTER)), tiles,
              args.reps)
        q, k, v = new(b, HEADS + 2 * KV_HEADS, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], 1)
        slots = torch.randperm(8192, device="cuda")[:b]
        pos = torch.randint(0, 4000, (b,), device="cuda")
        cos_sin = torch.randn(4096, HEAD_DIM, device="cuda")
        sweep(f"B={b:3d} qk", partial(qk, q, k, v, torch.empty_like(q), torch.empty_like(k),
                                      new(HEAD_DIM), pos, cos_sin, new(8192, KV_HEADS, HEAD_DIM),
                                      slots), warps, args.reps)


if __name__ == "__main__":
    main()
