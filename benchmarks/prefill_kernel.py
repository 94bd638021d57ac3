"""Causal varlen prefill attention alone on CUDA: time per layer and attention TFLOP/s.

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128, block 256), bf16: the
standard bench's 256 prompts in its prefill steps (<= 16,384 tokens each, dense k/v), and the
second 16,384-token chunk of a 32,768-token prompt (paged, after a cached prefix); the shipped
Triton launch, each --configs launch (BLOCK_M x BLOCK_N x warps x stages), and FlashAttention
when importable; each with its largest difference from the shipped launch's output.

    python -m benchmarks.prefill_kernel [--configs 128x64x8x3,64x64x4x3]
"""

import argparse
import statistics
from contextlib import nullcontext
from unittest import mock

import torch

from benchmarks.workloads import standard
from nanovllm.kernels import attention_triton
from nanovllm.kernels.attention_triton import prefill_attention_triton

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BUDGET = 16, 8, 128, 256, 16384


def standard_steps() -> list[list[int]]:
    """Prompt lengths of the standard bench (seed 0) in steps of <= BUDGET tokens (the
    scheduler's steps also split a prompt over two; these do not)."""
    lens = [len(p) for p in standard(256, (100, 1024), (100, 1024), 10000, seed=0)[0]]
    steps, step = [], []
    for n in lens:
        if sum(step) + n > BUDGET:
            steps.append(step)
            step = []
        step.append(n)
    return [*steps, step]


def dense_case(lens: list[int]) -> dict:
    """Inputs of a dense prefill over sequences of these lengths (q, k, v split from qkv)."""
    n = sum(lens)
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)
    return dict(q=q.view(n, HEADS, HEAD_DIM), k=k.view(n, KV_HEADS, HEAD_DIM),
                v=v.view(n, KV_HEADS, HEAD_DIM), k_cache=None, v_cache=None, cu_seqlens_q=cu,
                cu_seqlens_k=cu, block_tables=None, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                flops=sum(4 * HEADS * HEAD_DIM * x * (x + 1) / 2 for x in lens))


def paged_case(len_q: int, len_k: int) -> dict:
    """One sequence's last len_q queries over a paged cache of len_k keys (shuffled pages)."""
    pages = len_k // BLOCK_SIZE
    shape = (pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
    cu_q = torch.tensor([0, len_q], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, len_k], device="cuda", dtype=torch.int32)
    q = torch.randn(len_q, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    prefix = len_k - len_q
    return dict(q=q, k=None, v=None, k_cache=cache[0], v_cache=cache[1], cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, block_tables=table, max_seqlen_q=len_q, max_seqlen_k=len_k,
                flops=4 * HEADS * HEAD_DIM * len_q * (prefix + (len_q + 1) / 2))


def triton_run(case: dict, config: tuple | None):
    """The Triton launch of case (config: the launch constants, None: shipped)."""
    def run():
        patch = mock.patch.object(attention_triton, "_prefill_config",
                                  lambda *_: config) if config else nullcontext()
        with patch:
            return prefill_attention_triton(
                case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"],
                case["cu_seqlens_q"], case["cu_seqlens_k"], case["block_tables"],
                HEAD_DIM ** -0.5, max_seqlen_q=case["max_seqlen_q"])
    return run


def flash_run(case: dict):
    """FlashAttention's varlen prefill of case, or None if not importable."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    paged = case["block_tables"] is not None
    return lambda: flash_attn_varlen_func(
        case["q"], case["k_cache"] if paged else case["k"],
        case["v_cache"] if paged else case["v"], case["cu_seqlens_q"], case["cu_seqlens_k"],
        case["max_seqlen_q"], case["max_seqlen_k"], softmax_scale=HEAD_DIM ** -0.5,
        causal=True, block_table=case["block_tables"])


def time_ms(fns: list, reps: int = 10) -> float:
    """Median over reps of running every fn once (one per prefill step), in ms."""
    for fn in fns:
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for fn in fns:
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="",
                        help="comma list of BLOCK_MxBLOCK_NxWARPSxSTAGES launches to time too")
    args = parser.parse_args()
    configs = [None] + [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]
    cases = {"standard (9 steps)": [dense_case(s) for s in standard_steps()],
             **{f"one {n:,}-token prompt": [dense_case([n])] for n in (2048, 4096, 8192, BUDGET)},
             "32k prompt, 2nd chunk": [paged_case(BUDGET, 2 * BUDGET)]}
    print(f"{torch.cuda.get_device_name()}: ms per layer (TFLOP/s)")
    for name, steps in cases.items():
        flops = sum(c["flops"] for c in steps)
        runs = {str(cfg or "shipped"): [triton_run(c, cfg) for c in steps] for cfg in configs}
        if None not in (flash := [flash_run(c) for c in steps]):
            runs["flash-attn"] = flash
        reference = [fn() for fn in runs["shipped"]]
        row = []
        for label, fns in runs.items():
            try:  # a launch may not fit the GPU (shared memory)
                ms = time_ms(fns)
            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                row.append(f"{label} failed ({type(e).__name__})")
                continue
            # every launch must give the shipped launch's output (up to bf16 rounding)
            err = max((fn().float() - ref.float()).abs().max().item()
                      for fn, ref in zip(fns, reference))
            row.append(f"{label} {ms:.3f} ({flops / ms / 1e9:.0f}, err {err:.1e})")
        print(f"{name}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
