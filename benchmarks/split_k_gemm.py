"""Probe: o_proj and down_proj (N = 1,024) as split-K, swap-AB, TMA-fed Triton GEMMs that leave
float32 partials for the next kernel (add + RMSNorm) to sum, against cuBLAS.

    PYTHONPATH=. python -m benchmarks.split_k_gemm [--batches 16 64 128 256]

With N = 1,024 a swap-AB GEMM has only 16 programs of 64 weight rows per token tile; splitting
K over S programs fills the machine, and since the add + RMSNorm after these GEMMs reads whole
rows anyway it can sum the S partials itself (no reduce kernel, a fixed order). The weights are
stored k-major ([K, N], as RowParallelLinear keeps them); each program loads [BK, 64] tiles and
uses them transposed. Timed like gemm_layouts (28 distinct weights, one CUDA graph, us per call);
the cuBLAS column is torch.mm on the same k-major weight, as shipped."""

import argparse
import itertools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.gemm_layouts import LAYERS, layer_shapes, random_bf16
from benchmarks.runs import graph_replay_us, time_launches
from benchmarks.shapes import SHAPES


@triton.jit
def _split_k_kernel(wt_desc, x_desc, part_ptr, M, N, K_SPLIT, BN: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """Grid (N / BN, splits, token tiles): part[split, tokens, rows] = x[:, ks] @ W[rows, ks].T"""
    pid_n, split, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    acc = tl.zeros([BN, BT], tl.float32)
    k0 = split * K_SPLIT
    for k in tl.range(k0, k0 + K_SPLIT, BK, num_stages=STAGES):
        w = wt_desc.load([k, pid_n * BN]).T  # [BN, BK] of W from the [K, N] storage
        x = x_desc.load([pid_t * BT, k])
        acc = tl.dot(w, x.T, acc)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_t = pid_t * BT + tl.arange(0, BT)
    dst = part_ptr + (split * M + offs_t[None, :]).to(tl.int64) * N + offs_n[:, None]
    tl.store(dst, acc, mask=offs_t[None, :] < M)


def split_k(x, w_kn, part, bt, splits, bk, stages, warps):
    """fn() writing part[s] = x[:, K slice s] @ W[:, K slice s].T for a k-major weight w_kn."""
    m, k = x.shape
    n = w_kn.shape[1]
    wt_desc = TensorDescriptor.from_tensor(w_kn, [bk, 64])
    x_desc = TensorDescriptor.from_tensor(x, [bt, bk])
    grid = (n // 64, splits, triton.cdiv(m, bt))
    return lambda: _split_k_kernel[grid](wt_desc, x_desc, part, m, n, k // splits, BN=64, BT=bt,
                                         BK=bk, STAGES=stages, num_warps=warps)


def launches(m: int, k: int):
    top = min(max(16, triton.next_power_of_2(m)), 256)
    bts = sorted({top} | {t for t in (64, 128) if t < top})
    for bt, splits, bk, stages, warps in itertools.product(bts, (1, 2, 4, 8, 16), (64, 128),
                                                           (2, 3, 4), (4,)):
        if k % (splits * bk) == 0 and k // splits // bk >= 1:
            yield bt, splits, bk, stages, warps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--gemms", nargs="+", default=["o", "down"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    shapes = layer_shapes(SHAPES["qwen3-0.6b"])
    print(f"{torch.cuda.get_device_name()}: us per call, cuBLAS (k-major) / best split-K launch "
          "(BT, splits, BK, stages, warps) / next two")
    for name in args.gemms:
        n, k = shapes[name]
        ws = [random_bf16(k, n) for _ in range(LAYERS)]  # [K, N] storage
        for m in args.batches:
            x = random_bf16(m, k)
            ref = torch.mm(x, ws[0]).float()
            cublas = graph_replay_us(lambda x=x, ws=ws: [torch.mm(x, w) for w in ws],
                                     args.reps, 1) / LAYERS
            part = torch.empty(16, m, n, device="cuda", dtype=torch.float32)  # [:splits] used
            timed = time_launches(
                launches(m, k),
                lambda launch, x=x, ws=ws, part=part: [split_k(x, w, part[:launch[1]], *launch)
                                                       for w in ws],
                lambda launch, part=part, ref=ref: torch.allclose(
                    part[:launch[1]].sum(0), ref, rtol=2e-2, atol=2e-2), args.reps, LAYERS)
            rest = "  ".join(f"{us:.2f} {launch}" for us, launch in timed[1:3])
            print(f"{name:5s} M={m:3d} {cublas:6.2f} / {timed[0][0]:6.2f} {timed[0][1]} / {rest}",
                  flush=True)


if __name__ == "__main__":
    main()
