"""Every step of the standard workload beside its floor: where the time above the floor goes.

python -m benchmarks.step_floor [--model DIR] [--attention-backend B] [--out DIR] [--tiny]

One engine, one untimed warm-up, then one timed run of bench.py's throughput workload (random
Qwen3-0.6B shape in bf16 unless --model), with every step recorded as the engine launches it:
prefill or decode, batch size, tokens computed, K/V tokens its queries read, and two CUDA events
on the stream, before its inputs are copied and after its sampler. With the pipelined engine the
start event runs when the GPU reaches the step, so end - start is the step's GPU time (idle
moments inside the step included) and the next step's start - this end is GPU idle time between
steps: the host gap, counted with the step it delays. On CPU the step runs while the host waits,
so wall times replace the events. Each step's floor is benchmarks.floor.step_seconds: (weights
+ K/V read) / bandwidth or FLOPs / FLOP rate, whichever is larger. Steps are summed by kind and
batch-size bucket; the markdown table is printed last, and the steps and table go to --out as JSON.
"""
import argparse
import json
import os
import tempfile
from time import perf_counter

import torch

from benchmarks import workloads
from benchmarks.floor import BYTES, attention_flops, step_seconds
from benchmarks.runs import measure, open_engine

BUCKETS = ((1, 16), (17, 64), (65, 128), (129, 256), (257, 1 << 30))
COLUMNS = ("steps", "tokens", "gpu_s", "floor_s", "slack_s", "gap_s")


class StepRecorder:
    """Wraps a ModelRunner's launch: records each step's work and marks its start and end."""

    def __init__(self, runner):
        self.runner, self.launch = runner, runner.launch
        self.cuda = runner.device.type == "cuda"
        self.steps: list[dict] = []
        self.marks: list[tuple] = []
        runner.launch = self

    def __call__(self, seqs, is_prefill: bool, *args, **kwargs):
        if is_prefill:  # a chunk of num_scheduled_tokens after num_cached_tokens
            chunks = [(seq.num_scheduled_tokens, seq.num_cached_tokens) for seq in seqs]
        else:  # one token after the rest; num_tokens counts it
            chunks = [(1, seq.num_tokens - 1) for seq in seqs]
        self.steps.append(dict(prefill=is_prefill, batch=len(seqs),
                               tokens=sum(new for new, _ in chunks),
                               kv_tokens=sum(new + cached for new, cached in chunks),
                               chunks=chunks))
        start = self._mark()
        sampled = self.launch(seqs, is_prefill, *args, **kwargs)
        self.marks.append((start, self._mark()))
        return sampled

    def _mark(self) -> torch.cuda.Event | float:
        if not self.cuda:
            return perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def timed_steps(self) -> list[dict]:
        """The steps with gpu_s and gap_s (GPU idle before the step; 0 for the first)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for i, (step, (start, end)) in enumerate(zip(self.steps, self.marks)):
            gap = self._seconds(self.marks[i - 1][1], start) if i else 0.0
            out.append(dict(step, gpu_s=self._seconds(start, end), gap_s=gap))
        return out

    def remove(self) -> None:
        self.runner.launch = self.launch


def with_floors(steps: list[dict], shape: dict, bandwidth: float, flops: float,
                kv_itemsize: int = BYTES) -> list[dict]:
    """Each step plus floor_s and slack_s (GPU time above the floor)."""
    out = []
    for step in steps:
        chunks = step.pop("chunks")
        attn = sum(attention_flops(shape, new, cached) for new, cached in chunks) \
            if step["prefill"] else 0.0  # as benchmarks.floor: decode attention is bytes-bound
        floor = step_seconds(shape, step["tokens"], step["kv_tokens"], attn, bandwidth, flops,
                             kv_itemsize)
        out.append(dict(step, floor_s=floor, slack_s=step["gpu_s"] - floor))
    return out


def bucket_rows(steps: list[dict]) -> list[dict]:
    """Sums per (kind, batch bucket) with at least one step, then the total."""
    rows = []
    for prefill in (True, False):
        for lo, hi in BUCKETS:
            mine = [s for s in steps if s["prefill"] == prefill and lo <= s["batch"] <= hi]
            if mine:
                label = f"{lo}-{hi}" if hi < BUCKETS[-1][1] else f"{lo}+"
                rows.append(dict(kind="prefill" if prefill else "decode", batch=label,
                                 **{c: _sum(mine, c) for c in COLUMNS}))
    rows.append(dict(kind="total", batch="all", **{c: _sum(steps, c) for c in COLUMNS}))
    return rows


def _sum(steps: list[dict], column: str) -> float:
    return len(steps) if column == "steps" else sum(s[column] for s in steps)


def markdown(rows: list[dict]) -> str:
    lines = ["| kind | batch | steps | tokens | GPU s | floor s | slack s | GPU / floor | "
             "host gap s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['batch']} | {r['steps']} | {r['tokens']:,} | "
                     f"{r['gpu_s']:.3f} | {r['floor_s']:.3f} | {r['slack_s']:.3f} | "
                     f"{r['gpu_s'] / r['floor_s']:.2f} | {r['gap_s']:.3f} |")
    return "\n".join(lines)


def record_run(path: str, args: argparse.Namespace) -> dict:
    """One warmed-up engine, one recorded run of the throughput workload: run totals, steps."""
    size = workloads.sizes("throughput", args.tiny)
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path),
                                         seed=args.seed)
    with open(os.path.join(path, "config.json")) as f:
        shape = json.load(f)
    torch.manual_seed(args.seed)
    with open_engine(path, args) as (llm, _):
        recorder = StepRecorder(llm.model_runner)
        try:
            run = measure(llm, prompts, params)
        finally:
            recorder.remove()
        backend = llm.model_runner.backend.name
    steps = with_floors(recorder.timed_steps(), shape, args.bandwidth, args.flops,
                        1 if args.kv_cache_dtype == "fp8" else BYTES)
    run.pop("timeline")
    return dict(backend=backend, run=run, steps=steps, rows=bucket_rows(steps))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint (default: random Qwen3-0.6B shape, bf16)")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash-attn", "triton", "torch"])
    p.add_argument("--tiny", action="store_true",
                   help="bench.py's tiny throughput sizes and, without --model, a tiny checkpoint")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: the floors count one byte per cached K/V element")
    p.add_argument("--no-pipeline", action="store_true", help="lockstep engine")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (H200 copy)")
    p.add_argument("--flops", type=float, default=793e12, help="bf16 FLOP/s (H200 matmul)")
    p.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir(),
                   help="directory for step_floor_<backend>.json (default: $OUT or the temp dir)")
    args = p.parse_args(argv)
    args.tensor_parallel_size, args.load_format = 1, "auto"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from benchmarks.random_checkpoints import build_checkpoint, qwen3_0_6b_random
    if args.model:
        path = os.path.expanduser(args.model)
    elif args.tiny:
        path = build_checkpoint(tempfile.mkdtemp(prefix="nanovllm-tiny-"))
    else:
        path = qwen3_0_6b_random()
    result = record_run(path, args)
    run = result["run"]
    os.makedirs(args.out, exist_ok=True)
    fp8 = "_fp8" if args.kv_cache_dtype == "fp8" else ""
    out = os.path.join(args.out, f"step_floor_{result['backend']}{fp8}.json")
    with open(out, "w") as f:
        json.dump(dict(result, model=path, bandwidth=args.bandwidth, flops=args.flops), f)
    print(f"{result['backend']}: {run['output_tokens']:,} output tokens in {run['total_s']:.3f} s"
          f" ({run['output_tok_s']:,.0f} tok/s), {len(result['steps'])} steps; JSON: {out}\n")
    print(markdown(result["rows"]))
    return result


if __name__ == "__main__":
    main()
