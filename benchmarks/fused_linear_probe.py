"""The fused decode projections against cuBLAS + the kernel they replace, per batch size.

    PYTHONPATH=. python -m benchmarks.fused_linear_probe [--batches 1 16 64 256]

Qwen3-0.6B's qkv_proj (+ q/k norm, RoPE, K/V write) and gate_up_proj (+ SiLU-and-mul), 28
distinct bf16 weights each, one CUDA graph of 28 calls, us per call; then the largest
difference between the two paths' outputs."""

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.gemm_layouts import LAYERS
from benchmarks.runs import graph_replay_us
from nanovllm.kernels import fused_linear
from nanovllm.kernels.fused_ops import silu_and_mul
from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.layers.rotary_embedding import RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072


def row(m: int, qkv_w: list, gu_w: list, qn, kn, cs, cache, reps: int) -> str:
    """One batch size's line."""
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(m, HIDDEN, device=dev, dtype=bf16)
    pos = torch.randint(0, 4096, (m,), device=dev)
    slots = torch.randperm(512 * 256, device=dev)[:m]

    def unfused_qkv(w):
        q, k, v = F.linear(x, w).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                        KV_HEADS * HEAD_DIM], -1)
        return qk_norm_rope(q.view(m, HEADS, HEAD_DIM), k.view(m, KV_HEADS, HEAD_DIM), pos,
                            qn, kn, cs, 1e-6,
                            (v.view(m, KV_HEADS, HEAD_DIM), cache[0], cache[1], slots))[0]

    def fused_qkv(w):
        return fused_linear.qkv_rope_store(x, w, None, HEADS, KV_HEADS, pos, qn, kn, 1e-6, cs,
                                           cache[0], cache[1], slots)

    rows = []
    for name, a, b, ws in (
            ("qkv", unfused_qkv, fused_qkv, qkv_w),
            ("gate_up", lambda w: silu_and_mul(F.linear(x, w)),
             lambda w: fused_linear.gate_up_silu(x, w, None), gu_w)):
        want = a(ws[0])
        k_want = cache.clone()
        got = b(ws[0])
        diff = (got.float() - want.float()).abs().max().item()
        if name == "qkv":
            diff = max(diff, (cache.float() - k_want.float()).abs().max().item())
        ta = graph_replay_us(lambda a=a, ws=ws: [a(w) for w in ws], reps, 1) / LAYERS
        tb = graph_replay_us(lambda b=b, ws=ws: [b(w) for w in ws], reps, 1) / LAYERS
        rows.append(f"{name} {ta:6.2f} / {tb:6.2f} ({diff:.3g})")
    return f"M={m:3d}  " + "   ".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sweep", type=int, nargs="*", default=[],
                        help="batch sizes at which to time every (BLOCK_T, BLOCK_K, STAGES, warps)")
    args = parser.parse_args()
    dev, bf16 = "cuda", torch.bfloat16
    new = lambda *s: torch.randn(*s, device=dev, dtype=bf16) * 0.02  # noqa: E731
    qkv_w = [new((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN) for _ in range(LAYERS)]
    gu_w = [new(2 * INTER, HIDDEN) for _ in range(LAYERS)]
    qn, kn = (torch.ones(HEAD_DIM, device=dev, dtype=bf16) for _ in range(2))
    rope = RotaryEmbedding(HEAD_DIM, 4096, {"rope_type": "default", "rope_theta": 1e6}).to(dev)
    cache = torch.zeros(2, 512, 256, KV_HEADS, HEAD_DIM, device=dev, dtype=bf16)
    print(f"{torch.cuda.get_device_name()}: us per call, cuBLAS + kernel / fused; max |diff|")
    for m in args.batches:
        print(row(m, qkv_w, gu_w, qn, kn, rope.cos_sin_cache, cache, args.reps), flush=True)
    shipped = fused_linear._launch
    for m in args.sweep:
        for launch in itertools.product((16, 32, 64, 128), (64, 128), (3, 4, 6), (4, 8)):
            bt, bk, stages, _ = launch
            smem = (2 * 64 + bt) * bk * 2 * stages
            if bt < min(m, 64) // 2 or bt > max(16, 2 * m) or smem > 200_000:
                continue
            fused_linear._launch = lambda n, launch=launch: launch
            try:
                line = row(m, qkv_w, gu_w, qn, kn, rope.cos_sin_cache, cache, args.reps)
            except Exception as e:  # noqa: BLE001 - a launch that does not compile or fit
                line = f"M={m:3d}  failed: {type(e).__name__}"
            print(f"{launch} {line}", flush=True)
        fused_linear._launch = shipped


if __name__ == "__main__":
    main()
