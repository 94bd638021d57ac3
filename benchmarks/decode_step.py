"""Where a small-batch decode step's time goes: host phases, GPU time, and the floor.

python -m benchmarks.decode_step [--shape NAME] [--weight-format F] [--batch 1] [--tokens 256]
                                 [--lora-rank R] [--attention-backend B] [--max-model-len N]
                                 [--profile] [--tiny]

One engine (dummy weights of a benchmarks/shapes.py shape), `batch` prompts of 128 tokens, each
decoding `tokens` tokens (greedy, ignore_eos). After the prefill step every host method a decode
step runs is timed, inclusive, per step: the engine's step and its parts (advance, schedule,
launch, commit), and inside the launch the input packing and copy, the graph replay's launch,
the LM head's launch, the sampler's inputs and launch; inside the commit the wait for the ids.
CUDA events around each launch give the GPU time of a step and the GPU's idle time between
steps (the host's share of the step); the wall time per step is the mean and the median (a
slow first step or a pause shows as their difference). --lora-rank R runs every prompt through
one rank-R adapter (4 slots). --profile sums 16 steps' GPU kernels by phase beside each phase's
bandwidth floor (dense shapes), each kernel's time counted from the end of the GPU work before
it (with programmatic dependent launch kernels overlap their predecessors' tails), and lists the
costliest kernels. --tiny: a tiny random checkpoint on CPU (a smoke run).
"""
import argparse
import json
import os
import re
import statistics
import tempfile
from collections import defaultdict
from time import perf_counter

import torch

from benchmarks.floor import BYTES, head_dim, kv_bytes_per_token, weight_bytes
from benchmarks.shapes import SHAPES, WEIGHT_FORMATS
from benchmarks.step_floor import StepRecorder

# (label, depth, owner, attribute): owner names what _targets() resolves
PHASES = (("step", 0, "engine", "_step"),
          ("advance the in-flight step", 1, "scheduler", "advance"),
          ("schedule", 1, "engine", "_schedule"),
          ("launch", 1, "engine", "_launch"),
          ("decode inputs: pack, copy, carry", 2, "runner", "prepare_decode"),
          ("pack", 3, "inputs", "pack"),
          ("forward (a graph replay on CUDA)", 2, "runner", "forward"),
          ("LM head", 2, "model", "compute_logits"),
          ("sample", 2, "runner", "sample"),
          ("sampler launch", 3, "runner", "sampler"),
          ("commit", 1, "engine", "_commit"),
          ("wait for the ids", 2, "ids", "tolist"))
# GPU kernel name -> phase, first match wins (--profile). A lone token's qkv_proj GEMV
# (_gemv_rows_kernel) may also run its layer's input add + RMSNorm (norm_gemv_rows): qkv's.
KERNEL_PHASES = (("qkv + q/k norm + RoPE + cache write", r"qkv|qk_norm|store_kvcache|gemv_rows"),
                 ("attention", r"decode_split|decode_reduce|flash|fwd_kernel"),
                 ("gate_up + SiLU", r"gate_up|silu"),
                 ("o_proj, down_proj (split K)", r"split_k|gemv_partials"),
                 ("experts", r"moe|_down_kernel|_count_kernel|_offsets|_scatter"),
                 ("add + RMSNorm", r"rms_norm"),
                 ("LoRA shrink", r"shrink"),
                 ("sampler", r"race|argmax|sample"),
                 ("FP8 GEMMs (cuBLAS, W8A8) + activation quant", r"w8a8|group_quant|e4m3|f8f8"),
                 ("LM head, other GEMMs", r"gemm|gemv|nvjet|cutlass|xmma|sm90"),
                 ("other", r"."))


_INHERITED = object()  # HostPhases: the owner did not hold the attribute itself


class HostPhases:
    """Wraps methods with timers: total seconds per phase label, until restore()."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[object, str, object]] = []  # (owner, attribute, its own value)

    def wrap(self, owner: object, attribute: str, label: str) -> None:
        fn = getattr(owner, attribute)
        totals = self.totals

        def timed(*args, **kwargs):
            t = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += perf_counter() - t

        self._undo.append((owner, attribute, vars(owner).get(attribute, _INHERITED)))
        setattr(owner, attribute, timed)

    def reset(self) -> None:
        self.totals.clear()

    def restore(self) -> None:
        for owner, attribute, before in reversed(self._undo):
            if before is _INHERITED:  # a method looked up on the class: drop the wrapper
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, before)
        self._undo.clear()


def _targets(llm) -> dict[str, object]:
    from nanovllm.runner.sampled_ids import SampledIds
    runner = llm.model_runner
    return dict(engine=llm, scheduler=llm.scheduler, runner=runner, model=runner.model,
                inputs=runner.decode_inputs, ids=SampledIds)


def add_requests(llm, batch: int, tokens: int, max_id: int, lora=None) -> None:
    """`batch` distinct 128-token prompts, each decoding `tokens` greedy tokens."""
    from nanovllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        llm.add_request([(31 * i + 7 * j) % max_id + 1 for j in range(128)], params, lora)


def prefill(llm) -> None:
    """Step until every prompt is prefilled: a large batch's prompts take several steps, and
    the scheduler runs a decode step for those already prefilled between them (so these
    finish that many steps early)."""
    llm.step()
    while llm.scheduler.waiting:
        llm.step()


def run_decode(llm, batch: int, tokens: int, max_id: int, lora=None) -> dict:
    """Decode `tokens` tokens for `batch` prompts; host µs per phase, GPU µs per step."""
    add_requests(llm, batch, tokens, max_id, lora)
    phases, recorder = HostPhases(), StepRecorder(llm.model_runner)
    targets = _targets(llm)
    for label, _, owner, attribute in PHASES:
        phases.wrap(targets[owner], attribute, label)
    try:
        prefill(llm)  # untimed
        phases.reset()
        first = len(recorder.steps)
        ends = [perf_counter()]  # each step's end: the median shows what the mean's outliers hide
        while not llm.is_finished():
            llm.step()
            ends.append(perf_counter())
        num_steps, wall = len(ends) - 1, ends[-1] - ends[0]
    finally:
        phases.restore()
        recorder.remove()
    steps = recorder.timed_steps()[first:]
    us = {label: 1e6 * s / num_steps for label, s in phases.totals.items()}
    return dict(wall_us=1e6 * wall / num_steps, host_us=us, steps=num_steps,
                wall_median_us=1e6 * statistics.median(b - a for a, b in zip(ends, ends[1:])),
                gpu_us=1e6 * statistics.median(s["gpu_s"] for s in steps),
                gap_us=1e6 * statistics.median(s["gap_s"] for s in steps))


def phase_floors(shape: dict, batch: int, context: int, weight_itemsize: float,
                 bandwidth: float) -> dict[str, float]:
    """µs to read each phase's weights (and the K/V) once: dense shapes only."""
    hidden, layers, dim = shape["hidden_size"], shape["num_hidden_layers"], head_dim(shape)
    q, kv = shape["num_attention_heads"] * dim, shape["num_key_value_heads"] * dim
    inter = shape["intermediate_size"]
    params = {"qkv + q/k norm + RoPE + cache write": hidden * (q + 2 * kv),
              "o_proj, down_proj (split K)": q * hidden + inter * hidden,
              "gate_up + SiLU": 2 * hidden * inter}
    out = {k: 1e6 * layers * n * weight_itemsize / bandwidth for k, n in params.items()}
    out["attention"] = 1e6 * batch * context * kv_bytes_per_token(shape) / bandwidth
    out["LM head, other GEMMs"] = 1e6 * shape["vocab_size"] * hidden * BYTES / bandwidth
    return out


def exclusive_times(kernels: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    """{name: [µs, launches]} of (name, start µs, end µs) kernels, each counted from when the
    GPU's previous work ended: under programmatic dependent launch a kernel starts while its
    predecessor runs and waits for it, so plain durations count that overlap twice."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy_until = float("-inf")
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        out[name][0] += max(0.0, end - max(start, busy_until))
        out[name][1] += 1
        busy_until = max(busy_until, end)
    return dict(out)


def phase_of(kernel: str) -> str:
    """The KERNEL_PHASES label of a kernel name (first match)."""
    return next(p for p, pattern in KERNEL_PHASES if re.search(pattern, kernel))


def kernel_phases(llm, batch: int, steps: int, max_id: int, lora=None
                  ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(GPU µs per decode step by phase, {kernel: [µs, launches] per step}) over `steps`
    steps, from the profiler's kernel intervals (exclusive_times)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    add_requests(llm, batch, 2 * steps, max_id, lora)  # tokens left for `steps` full steps
    prefill(llm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    while not llm.is_finished():
        llm.step()
    intervals = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == DeviceType.CUDA]
    per_kernel = {name: [us / steps, n / steps]
                  for name, (us, n) in exclusive_times(intervals).items()}
    phases: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        phases[phase_of(name)] += us
    return phases, per_kernel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--weight-format", default="bf16", choices=sorted(WEIGHT_FORMATS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-model-len", type=int,
                   help="default 4096 (1024 with --tiny); a CUDA graph's decode splits follow "
                        "its block table's width, so a lone token's split count does too")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--bandwidth", type=float, default=4.27e12, help="bytes/s (H200 copy)")
    p.add_argument("--tiny", action="store_true")
    return p.parse_args(argv)


def open_llm(args: argparse.Namespace):
    """(LLM, checkpoint path, its shape, a LoRARequest or None)."""
    from benchmarks.random_checkpoints import build_checkpoint
    from benchmarks.shapes import write_shape
    from nanovllm import LLM
    root = tempfile.mkdtemp(prefix="nanovllm-decode-step-")
    kwargs = dict(max_model_len=args.max_model_len or (1024 if args.tiny else 4096),
                  attention_backend=args.attention_backend)
    if args.tiny:
        path = build_checkpoint(os.path.join(root, "model"))
        kwargs.update(num_kvcache_blocks=64)
    else:
        path = write_shape(args.shape, os.path.join(root, "model"), args.weight_format)
        kwargs.update(load_format="dummy", gpu_memory_utilization=0.85)
    lora = None
    if args.lora_rank:
        from benchmarks.lora import write_adapter
        from nanovllm.lora import LoRARequest
        lora = LoRARequest("a", 1, write_adapter(path, os.path.join(root, "adapter"),
                                                 args.lora_rank, 0))
        kwargs.update(enable_lora=True, max_loras=4, max_lora_rank=args.lora_rank)
    with open(os.path.join(path, "config.json")) as f:
        shape = json.load(f)
    return LLM(path, **kwargs), shape, lora


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    llm, shape, lora = open_llm(args)
    max_id = shape["vocab_size"] - 1
    limits = dict(llm.model_runner.fused_limits)
    max_model_len = llm.model_runner.config.max_model_len
    try:
        run = run_decode(llm, args.batch, args.tokens, max_id, lora)
        kernels, per_kernel = (kernel_phases(llm, args.batch, 16, max_id, lora)
                               if args.profile and torch.cuda.is_available() else ({}, {}))
    finally:
        llm.shutdown()
    context = 128 + args.tokens // 2
    wbytes = 1 if args.weight_format.startswith("fp8") else BYTES
    floor_us = 1e6 * (weight_bytes(shape, args.batch, wbytes)
                      + args.batch * context * kv_bytes_per_token(shape)) / args.bandwidth
    print(f"\n{'tiny' if args.tiny else f'{args.shape} {args.weight_format}'}, batch "
          f"{args.batch}{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}: "
          f"{run['wall_us']:.0f} us a decode step over {run['steps']} steps (median "
          f"{run['wall_median_us']:.0f}); GPU "
          f"{run['gpu_us']:.0f} us a step (median), idle {run['gap_us']:.0f} us between steps; "
          f"floor {floor_us:.0f} us; max_model_len {max_model_len}")
    if limits:  # start-up measures them: a step's kernels depend on them
        print("fused decode projections up to (tokens, measured at start-up): "
              + ", ".join(f"{name}: {n}" for name, n in limits.items()))
    print("\n| host phase (inclusive) | us per step |\n|---|---|")
    for label, depth, *_ in PHASES:
        print(f"| {'- ' * depth}{label} | {run['host_us'].get(label, 0.0):.1f} |")
    if kernels:
        floors = (phase_floors(shape, args.batch, context, wbytes, args.bandwidth)
                  if "num_experts" not in shape else {})
        print("\n| GPU phase | us per step | floor us |\n|---|---|---|")
        for label, _ in KERNEL_PHASES:
            if label in kernels:
                floor = floors.get(label)
                print(f"| {label} | {kernels[label]:.1f} | "
                      f"{'-' if floor is None else f'{floor:.1f}'} |")
        print(f"| total | {sum(kernels.values()):.1f} | {floor_us:.1f} |")
        print("\n| kernel (top 12, exclusive time) | us per step | launches per step |\n"
              "|---|---|---|")
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
        for name, (us, n) in top:
            print(f"| {name[:70]} | {us:.1f} | {n:g} |")
    return dict(run, kernels=dict(kernels), per_kernel=per_kernel, floor_us=floor_us,
                max_model_len=max_model_len)


if __name__ == "__main__":
    main()
