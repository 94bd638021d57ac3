"""Probe: can a decode GEMM stream its weights while the kernel before it runs?

    PYTHONPATH=. python -m benchmarks.pdl_prefetch [--batches 16 64 128 256]

A chain of 28 layers of Qwen3-0.6B's shape, each RMSNorm -> qkv GEMM -> RMSNorm -> gate_up GEMM
(each kernel reads the one before's output), one CUDA graph per variant, us per layer:
  cublas     F.linear and a plain RMSNorm kernel
  tma        the swap-AB TMA GEMM of benchmarks.tma_gemm, everything launched plainly
  pdl        the same with programmatic dependent launch: every kernel releases its dependents
             at once and waits for its predecessor before touching activations
  pdl-l2     pdl, and each GEMM program first asks for its weight slice (contiguous rows) with
             one cp.async.bulk.prefetch.L2 before the wait: weights do not depend on the
             previous kernel, so their DRAM reads can overlap it
"""

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.gemm_layouts import LAYERS, layer_shapes, random_bf16
from benchmarks.runs import graph_replay_us
from benchmarks.shapes import SHAPES
from benchmarks.tma_gemm import _swap_ab_kernel


@triton.jit
def _rms_norm_kernel(x_ptr, stride_x, w_ptr, out_ptr, eps, H: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, H)
    w = tl.load(w_ptr + cols).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    tl.store(out_ptr + row * H + cols, (x * rstd * w).to(out_ptr.dtype.element_ty))


def rms_norm(x, w, out, pdl):
    """out = RMSNorm(x[:, :H]) (x may be a wider row)."""
    extra = {"launch_pdl": True} if pdl else {}
    _rms_norm_kernel[(x.shape[0],)](x, x.stride(0), w, out, 1e-6, H=w.shape[0], PDL=pdl,
                                    num_warps=4, **extra)
    return out


def tma_linear(x, w, out, pdl, prefetch):
    """out = x @ w.T through the swap-AB kernel (tma_gemm's best launches)."""
    m, k = x.shape
    n = w.shape[0]
    bt = 16 if m <= 16 else 32 if m <= 128 else 64
    bn, bk = 64, 128
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    x_desc = TensorDescriptor.from_tensor(x, [bt, bk])
    extra = {"launch_pdl": True} if pdl else {}
    _swap_ab_kernel[(n // bn, triton.cdiv(m, bt))](
        w, w_desc, x_desc, out, m, n, k, BN=bn, BT=bt, BK=bk, STAGES=4, PDL=pdl,
        PREFETCH=prefetch, num_warps=4, **extra)
    return out


def chain(h, weights, norm_w, variant):
    """fn() running the 28-layer chain for batch m; its buffers are allocated once."""
    qkv_w, gu_w = weights
    m = h.shape[0]
    qkv = torch.empty(m, qkv_w[0].shape[0], device="cuda", dtype=torch.bfloat16)
    gu = torch.empty(m, gu_w[0].shape[0], device="cuda", dtype=torch.bfloat16)
    h2 = torch.empty_like(h)
    pdl = variant.startswith("pdl")

    def linear(x, w, out):
        if variant == "cublas":
            return torch.matmul(x, w.T, out=out)
        return tma_linear(x, w, out, pdl, variant == "pdl-l2")

    def step():
        for layer in range(LAYERS):
            rms_norm(gu if layer else h, norm_w, h2, pdl)
            linear(h2, qkv_w[layer], qkv)
            rms_norm(qkv, norm_w, h2, pdl)
            linear(h2, gu_w[layer], gu)
        return gu
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    shapes = layer_shapes(SHAPES["qwen3-0.6b"])
    weights = tuple([random_bf16(*shapes[name]) for _ in range(LAYERS)]
                    for name in ("qkv", "gate_up"))
    norm_w = random_bf16(shapes["qkv"][1])
    variants = ("cublas", "tma", "pdl", "pdl-l2")
    print(f"{torch.cuda.get_device_name()}: us per layer (norm, qkv, norm, gate_up)")
    print("| M | " + " | ".join(variants) + " |")
    for m in args.batches:
        h = random_bf16(m, norm_w.shape[0])
        steps = {v: chain(h, weights, norm_w, v) for v in variants}
        ref = steps["cublas"]().float().clone()
        for v, step in steps.items():
            err = (step().float() - ref).abs().max().item() / ref.abs().max().item()
            assert err < 5e-2, f"{v} M={m}: relative error {err}"
        us = {v: [] for v in variants}
        for _ in range(3):  # alternate the variants so that drift hits all alike
            for v, step in steps.items():
                us[v].append(graph_replay_us(step, args.reps, 1) / LAYERS)
        print(f"| {m} | " + " | ".join(f"{sorted(us[v])[1]:.2f}" for v in variants) + " |",
              flush=True)


if __name__ == "__main__":
    main()
