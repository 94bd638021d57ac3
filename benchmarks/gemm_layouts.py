"""The decode GEMMs under cuBLAS with the weight stored [N, K] (F.linear) or [K, N] (mm).

    PYTHONPATH=. python -m benchmarks.gemm_layouts [--shape qwen3-0.6b] [--batches 1 16 256]

A model's four layer GEMMs (qkv, o, gate_up, down) with 28 distinct bf16 weights each (so L2
cannot hold them), one CUDA graph of 28 calls per shape, us per call, median over replays; then
the whole 112-GEMM chain of a decode step, ms. Run it under different cuBLAS environment
variables (CUBLAS_WORKSPACE_CONFIG, CUBLASLT_WORKSPACE_SIZE) in separate processes."""

import argparse

import torch
import torch.nn.functional as F

from benchmarks.floor import head_dim
from benchmarks.runs import graph_replay_us
from benchmarks.shapes import SHAPES

LAYERS = 28
LM_HEAD = {"lm_head": (151936, 1024)}


def random_bf16(*shape: int) -> torch.Tensor:
    """Random bf16 values at a weight's scale (std 0.02), on the GPU."""
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02


def layer_shapes(shape: dict) -> dict:
    """(N, K) of a decoder layer's qkv, o, gate_up and down GEMMs."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * head_dim(shape), \
        shape["num_key_value_heads"] * head_dim(shape)
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def calls(x, weights, transposed: bool):
    """fn() running x @ W^T for each of the layers' weights (W^T given as [K, N] if transposed)."""
    if transposed:
        return lambda: [torch.mm(x, w) for w in weights]
    return lambda: [F.linear(x, w) for w in weights]


def row(m: int, shapes: dict, weights: dict, weights_t: dict, reps: int) -> str:
    """One line at batch m: us per call of each GEMM in both layouts, then the chain's ms."""
    xs = {name: random_bf16(m, k) for name, (n, k) in shapes.items()}
    for name in shapes:
        got = torch.mm(xs[name], weights_t[name][0])
        torch.testing.assert_close(got, F.linear(xs[name], weights[name][0]))
    out = [f"M={m:3d}"]
    for name, ws in weights.items():
        tn = graph_replay_us(calls(xs[name], ws, False), reps, 1) / len(ws)
        nn = graph_replay_us(calls(xs[name], weights_t[name], True), reps, 1) / len(ws)
        out.append(f"{name} {tn:5.2f}/{nn:5.2f}")
    chain = {}
    for transposed, layout in ((False, weights), (True, weights_t)):
        fns = [calls(xs[name], layout[name], transposed) for name in shapes]
        step = lambda fns=fns: [f() for f in fns]  # noqa: E731
        chain[transposed] = graph_replay_us(step, reps, 1) / 1e3
    out.append(f"chain {chain[False]:.3f}/{chain[True]:.3f}")
    return "  ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b",
                        help="the model whose layer GEMMs to time (MoE: only qkv and o count)")
    parser.add_argument("--lm-head", action="store_true",
                        help="instead: the LM head's GEMM (151,936 x 1,024), 4 weights")
    args = parser.parse_args()
    shapes = LM_HEAD if args.lm_head else layer_shapes(SHAPES[args.shape])
    copies = 4 if args.lm_head else LAYERS
    weights = {name: [random_bf16(n, k) for _ in range(copies)] for name, (n, k) in shapes.items()}
    weights_t = {name: [w.t().contiguous() for w in ws] for name, ws in weights.items()}
    print(f"{torch.cuda.get_device_name()}, {args.shape} {shapes}: us per GEMM call "
          "[N,K] / [K,N]; chain ms per step")
    for m in args.batches:
        print(row(m, shapes, weights, weights_t, args.reps), flush=True)


if __name__ == "__main__":
    main()
