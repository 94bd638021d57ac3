"""race_sample on CUDA: microseconds per call at each batch (compare commits from worktrees).

    PYTHONPATH=. python -m benchmarks.sample_kernel [--batches 16 64 128 256] [--reps 50]
"""

import argparse
from functools import partial

import torch

from benchmarks.runs import graph_replay_us
from nanovllm.kernels.sample import race_sample

VOCAB, TEMPERATURE, CALLS = 151936, 0.6, 10  # CALLS per graph replay: spreads launch latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, V = {VOCAB}, bf16 logits, T = {TEMPERATURE}")
    for batch in args.batches:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        logits = torch.randn(batch, VOCAB, device="cuda", generator=gen).bfloat16()
        temps = torch.full((batch,), TEMPERATURE, device="cuda")
        us = graph_replay_us(partial(race_sample, logits, temps, 1234), args.reps, CALLS)
        read_us = logits.numel() * logits.element_size() / 4.8e6  # at H200's 4.8 TB/s
        print(f"B={batch:4d}  {us:7.1f} us  (reading the logits: {read_us:5.1f} us)")


if __name__ == "__main__":
    main()
