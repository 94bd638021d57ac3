"""One-token decode projections: the GEMV (kernels.linear.gemv) against the MMA kernels it
replaces there, per weight shape (H200).

python -m benchmarks.gemv_probe [--layers 32] [--tiny]: for each shape a CUDA graph of `layers`
launches over as many distinct weights (more bytes than L2 holds), replayed 20 times after 3;
µs per launch (median) beside the weight's bytes time, for split_k_linear's partials (o_proj,
down_proj, an unfused qkv_proj), gate_up_silu and qkv_rope_store (its GEMV: whole rows, then
the q/k kernel); both paths' outputs must agree. --tiny: small float16 shapes on CPU, Triton
interpreted, timed without graphs (a smoke run).
"""
import argparse
import os
import sys
import time
from unittest import mock

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import triton

from benchmarks.moe_sweep import time_call  # noqa: E402
from nanovllm.kernels.linear import fused, fused_gate_up, split_k  # noqa: E402
from nanovllm.kernels.linear.fp8_reference import FP8_DTYPE  # noqa: E402

BANDWIDTH = 4.27e12  # bytes/s, the H200's measured copy bandwidth
SHAPES = {  # name: (N, K, weight dtype, op[, kv heads]); "gate_up": N = 2 x intermediate
    "Qwen3-0.6B qkv + q/k norm, RoPE, K/V write, bf16": (4096, 1024, torch.bfloat16, "qkv", 8),
    "Qwen3-0.6B o_proj, bf16": (1024, 2048, torch.bfloat16, "partials"),
    "Qwen3-0.6B down_proj, bf16": (1024, 3072, torch.bfloat16, "partials"),
    "Qwen3-0.6B gate_up + SiLU, bf16": (6144, 1024, torch.bfloat16, "gate_up"),
    "Llama-3.1-8B qkv_proj, FP8": (6144, 4096, FP8_DTYPE, "partials"),
    "Llama-3.1-8B o_proj, FP8": (4096, 4096, FP8_DTYPE, "partials"),
    "Llama-3.1-8B down_proj, FP8": (4096, 14336, FP8_DTYPE, "partials"),
    "Llama-3.1-8B gate_up + SiLU, FP8": (28672, 4096, FP8_DTYPE, "gate_up"),
    "Llama-3.1-8B gate_up + SiLU, bf16": (28672, 4096, torch.bfloat16, "gate_up"),
    "Llama-3.1-8B qkv + RoPE, K/V write, FP8": (6144, 4096, FP8_DTYPE, "qkv", 8),
}
TINY = {"o_proj, fp16": (64, 512, torch.float16, "partials"),
        "qkv_proj, FP8": (128, 256, FP8_DTYPE, "partials"),
        "gate_up + SiLU, fp16": (256, 128, torch.float16, "gate_up"),
        "gate_up + SiLU, FP8": (256, 256, FP8_DTYPE, "gate_up"),
        "qkv + q/k norm, RoPE, K/V write, fp16": (512, 256, torch.float16, "qkv", 1)}
HEAD_DIM = 128  # a "qkv" shape's: N / 128 heads, kv heads of them for K and as many for V


def _qkv_launcher(ws: list, x: torch.Tensor, scale, n: int, kv_heads: int, device: str):
    """launch(i): qkv_rope_store of x with ws[i] at position 7 into slot 3 (q/k norm on 16-bit
    weights, as Qwen3; none on FP8 ones, as Llama)."""
    heads = n // HEAD_DIM
    cache = torch.zeros(1, 16, kv_heads, HEAD_DIM, dtype=x.dtype, device=device)
    cos_sin = torch.randn(16, HEAD_DIM, device=device)
    norm = None if scale is not None else torch.ones(HEAD_DIM, dtype=x.dtype, device=device)
    pos, slot = (torch.tensor([v], device=device) for v in (7, 3))
    return lambda i: fused.qkv_rope_store(
        x, ws[i], None, heads - 2 * kv_heads, kv_heads, pos, norm, norm, 1e-6, cos_sin, cache,
        cache.clone(), slot, w_scale=scale)


def time_chain(launch, layers: int) -> float:
    """µs per launch: moe_sweep.time_call's median graph replay of `layers` launch(i) calls
    (on CPU, the calls themselves, timed once)."""
    if torch.cuda.is_available():
        flush = torch.empty(1, device="cuda")  # the weights, not a flush, outgrow L2 here
        return time_call(torch, lambda: [launch(i) for i in range(layers)][-1], flush)[0] \
            / layers
    for i in range(layers):
        launch(i)
    start = time.perf_counter()
    for i in range(layers):
        launch(i)
    return (time.perf_counter() - start) * 1e6 / layers


def _weights(n: int, k: int, dtype: torch.dtype, op: str, layers: int, device: str
             ) -> list[torch.Tensor]:
    """`layers` random weights as the layers keep them: 16-bit o/down k-major."""
    ws = [(torch.randn(n, k, device=device) * k ** -0.5).to(dtype) for _ in range(layers)]
    if op == "partials" and dtype != FP8_DTYPE:
        ws = [w.t().contiguous().t() for w in ws]
    return ws


def probe(n: int, k: int, dtype: torch.dtype, op: str, layers: int, act: torch.dtype,
          device: str, kv_heads: int = 0) -> tuple[float, float]:
    """(MMA µs, GEMV µs) per launch at one token of dtype act."""
    ws = _weights(n, k, dtype, op, layers, device)
    scale = torch.rand(n, 1, device=device) + 0.5 if dtype == FP8_DTYPE else None
    x = torch.randn(1, k, device=device, dtype=act)
    if op == "partials":
        def launch(i):
            return split_k.split_k_linear(x, ws[i], w_scale=scale)
        target = "nanovllm.kernels.linear.split_k.runs_gemv"
    elif op == "gate_up":
        def launch(i):
            return fused_gate_up.gate_up_silu(x, ws[i], None, w_scale=scale)
        target = "nanovllm.kernels.linear.fused_gate_up.runs_gate_up_gemv"
    else:
        launch = _qkv_launcher(ws, x, scale, n, kv_heads, device)
        target = "nanovllm.kernels.linear.fused.runs_gemv_rows"
    gemv_out = launch(0)
    with mock.patch(target, return_value=False):
        mma_out = launch(0)
        mma = time_chain(launch, layers)
    if op == "partials":
        gemv_out, mma_out = gemv_out.sum(0), mma_out.sum(0)
    torch.testing.assert_close(gemv_out.float(), mma_out.float(), atol=5e-2, rtol=5e-2)
    return mma, time_chain(launch, layers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="small float16 shapes, CPU (a smoke run)")
    args = p.parse_args()
    shapes, layers = (TINY, 2) if args.tiny else (SHAPES, args.layers)
    act = torch.float16 if args.tiny else torch.bfloat16  # the interpreter's TMA lacks bf16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("| projection, one token | bytes time us | MMA us | GEMV us |\n|---|---|---|---|")
    for name, (n, k, dtype, op, *kv_heads) in shapes.items():
        floor = n * k * (1 if dtype == FP8_DTYPE else 2) / BANDWIDTH * 1e6
        mma, gemv = probe(n, k, dtype, op, layers, act, device, *kv_heads)
        print(f"| {name} | {floor:.2f} | {mma:.2f} | {gemv:.2f} |", flush=True)


if __name__ == "__main__":
    main()
