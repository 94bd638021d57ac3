"""The decode GEMMs under cuBLAS with the weight stored [N, K] (F.linear) or [K, N] (mm).

    PYTHONPATH=. python -m benchmarks.gemm_layouts [--shape qwen3-0.6b] [--batches 1 16 256]

A model's four layer GEMMs (qkv, o, gate_up, down) with 28 distinct bf16 weights each (so L2
cannot hold them), one CUDA graph of 28 calls per shape, us per call, median over replays; then
the whole 112-GEMM chain of a decode step, ms. Run it under different cuBLAS environment
variables (CUBLAS_WORKSPACE_CONFIG, CUBLASLT_WORKSPACE_SIZE) in separate processes."""

import argparse

import torch
import torch.nn.functional as F

from benchmarks.runs import graph_replay_us
from benchmarks.shapes import SHAPES as MODEL_SHAPES

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LAYERS = 28


def layer_shapes(cfg: dict) -> dict:
    """(N, K) of a decoder layer's qkv, o, gate_up and down GEMMs."""
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * cfg["intermediate_size"], hidden),
            "down": (hidden, cfg["intermediate_size"])}


def calls(x, weights, transposed: bool):
    """fn() running x @ W^T for each of the layers' weights (W^T given as [K, N] if transposed)."""
    if transposed:
        return lambda: [torch.mm(x, w) for w in weights]
    return lambda: [F.linear(x, w) for w in weights]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b",
                        help="the model whose layer GEMMs to time (MoE: only qkv and o count)")
    parser.add_argument("--lm-head", action="store_true",
                        help="instead: the LM head's GEMM (151,936 x 1,024), 4 weights")
    args = parser.parse_args()
    SHAPES.update(layer_shapes(MODEL_SHAPES[args.shape]))
    if args.lm_head:
        SHAPES.clear()
        SHAPES["lm_head"] = (151936, 1024)
    new = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02  # noqa: E731
    copies = 4 if args.lm_head else LAYERS
    weights = {name: [new(n, k) for _ in range(copies)] for name, (n, k) in SHAPES.items()}
    weights_t = {name: [w.t().contiguous() for w in ws] for name, ws in weights.items()}
    print(f"{torch.cuda.get_device_name()}, {args.shape} {SHAPES}: us per GEMM call "
          "[N,K] / [K,N]; chain ms per step")
    for m in args.batches:
        xs = {name: new(m, k) for name, (n, k) in SHAPES.items()}
        for name in SHAPES:
            got = torch.mm(xs[name], weights_t[name][0])
            torch.testing.assert_close(got, F.linear(xs[name], weights[name][0]))
        row = [f"M={m:3d}"]
        for name in SHAPES:
            tn = graph_replay_us(calls(xs[name], weights[name], False), args.reps, 1) / copies
            nn = graph_replay_us(calls(xs[name], weights_t[name], True), args.reps, 1) / copies
            row.append(f"{name} {tn:5.2f}/{nn:5.2f}")
        chain = {}
        for transposed, ws in ((False, weights), (True, weights_t)):
            fns = [calls(xs[name], ws[name], transposed) for name in SHAPES]
            step = lambda fns=fns: [f() for f in fns]  # noqa: E731
            chain[transposed] = graph_replay_us(step, args.reps, 1) / 1e3
        row.append(f"chain {chain[False]:.3f}/{chain[True]:.3f}")
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
