"""GPU time per kernel for the standard workload's prefill steps and for decode steps (H200).

python -m benchmarks.profile_steps [--model DIR | --shape S [--weight-format F]]
[--attention-backend B] [--kv-cache-dtype D]: prints, for a prefill-only pass (every prompt,
max_tokens=1) and for 32 decode steps at batch 256, the kernels by total GPU time, then the
wall time of each phase. --tiny: a tiny random checkpoint and 8 prompts on CPU, ops by CPU
time (a smoke run).
"""
import argparse
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.random_checkpoints import build_checkpoint, qwen3_0_6b_random
from benchmarks.runs import sync
from benchmarks.shapes import SHAPES, WEIGHT_FORMATS, write_shape
from benchmarks.workloads import max_token_id, standard
from nanovllm import LLM, SamplingParams


def table(prof, title: str, rows: int = 30) -> None:
    """Kernels by summed GPU time, with their share (without CUDA: ops by their own CPU time)."""
    cuda = torch.cuda.is_available()
    us = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = [e for e in prof.key_averages() if us(e) > 0]
    total = sum(map(us, events))
    print(f"== {title}: {total / 1e3:.1f} ms of {'GPU' if cuda else 'CPU'} time in "
          f"{len(events)} {'kernel' if cuda else 'op'} names")
    for e in sorted(events, key=lambda e: -us(e))[:rows]:
        print(f"{us(e) / 1e3:9.2f} ms {100 * us(e) / total:5.1f}% x{e.count:<6d} {e.key[:90]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-seqs", type=int)
    p.add_argument("--shape", choices=sorted(SHAPES), help="dummy weights of a model's shape")
    p.add_argument("--weight-format", default="bf16", choices=sorted(WEIGHT_FORMATS))
    p.add_argument("--tiny", action="store_true", help="tiny random checkpoint, 8 prompts (CPU)")
    args = p.parse_args()
    if args.shape and (args.model or args.tiny):
        p.error("--shape builds its own dummy checkpoint: not with --model or --tiny")
    if args.weight_format != "bf16" and not args.shape:
        p.error("--weight-format needs --shape")
    args.num_seqs = args.num_seqs or (8 if args.tiny else 256)
    kwargs = dict(attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype)
    if args.shape:
        path = write_shape(args.shape, tempfile.mkdtemp(prefix="nanovllm-shape-"),
                           args.weight_format)
        kwargs.update(load_format="dummy", max_model_len=4096)
    else:
        path = args.model or (build_checkpoint(tempfile.mkdtemp(prefix="nanovllm-tiny-"))
                              if args.tiny else qwen3_0_6b_random())
    llm = LLM(path, **kwargs)
    prompts, _ = standard(args.num_seqs, (100, 1024), (100, 1024), max_token_id(path), seed=0)
    one = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:8], one, use_tqdm=False)  # warm-up
    for title, params in ((f"prefill ({args.num_seqs} prompts, 1 token)", one),
                          (f"prefill + 32 decode steps at batch {args.num_seqs}",
                           SamplingParams(temperature=0.6, max_tokens=33, ignore_eos=True))):
        llm.reset_prefix_cache()
        sync()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        wall = time.perf_counter() - t0
        llm.reset_prefix_cache()
        cuda = torch.cuda.is_available()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            sync()
        table(prof, f"{title}, wall {wall * 1e3:.0f} ms unprofiled")
    llm.shutdown()


if __name__ == "__main__":
    main()
