"""What RL rollouts add to the standard workload, on one engine: logprobs=5 and n=4 on every
request against the plain run, GPU memory after sleep(1) and sleep(2), and the time of
wake_up and of update_weights (from host and from GPU tensors)."""
import argparse
import glob
import os
from dataclasses import replace
from time import perf_counter

import torch

from benchmarks import workloads
from benchmarks.cli import standard_size
from benchmarks.runs import GiB, engine_env, open_engine, sync


def rl(args: argparse.Namespace, path: str) -> dict:
    """The standard workload plain, with logprobs=5 and with n=4; then a sleep/wake cycle."""
    size = standard_size(args)
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path),
                                         seed=args.seed)
    variants = {"plain": params, "logprobs=5": [replace(p, logprobs=5) for p in params],
                "n=4": [replace(p, n=4) for p in params]}
    with open_engine(path, args) as (llm, startup_s):
        runs = {label: timed(llm, prompts, ps) for label, ps in variants.items()}
        for label in ("logprobs=5", "n=4"):
            runs[label]["time_vs_plain"] = runs[label]["total_s"] / runs["plain"]["total_s"]
        runs["plain"]["engine"] = engine_env(llm, startup_s)
        cycle = sleep_cycle(llm, path, prompts[:8])
    return dict(workload=size, runs=runs, sleep=cycle)


def timed(llm, prompts: list[list[int]], params: list) -> dict:
    """One generate() from an empty prefix cache; output tokens of every completion."""
    llm.reset_prefix_cache()
    llm.reset_stats()
    sync()
    t = perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = perf_counter() - t
    tokens = sum(len(c["token_ids"]) for o in outs for c in o["outputs"])
    stats = llm.stats()
    return dict(total_s=elapsed, output_tokens=tokens, output_tok_s=tokens / elapsed,
                completions=sum(len(o["outputs"]) for o in outs),
                prefill_tokens=stats["prefill_tokens"], cache_hit_blocks=stats["cache_hit_blocks"],
                preemptions=stats["preemptions"])


def sleep_cycle(llm, path: str, prompts: list[list[int]]) -> dict:
    """Memory after sleep(1) and sleep(2), wake_up and update_weights times, and whether greedy
    outputs are unchanged after each round trip."""
    from safetensors.torch import load_file

    from nanovllm import SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def tokens() -> list[list[int]]:
        return [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]

    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(file))
    expected, out = tokens(), dict(awake=memory())
    # Dummy weights (--shape) have no checkpoint to reload after sleep(2): level 1 only.
    for level in (1, 2) if state else (1,):
        out[f"sleep{level}_s"] = _seconds(llm.sleep, level)
        out[f"sleep{level}"] = memory()
        out[f"wake{level}_s"] = _seconds(llm.wake_up)
        if level == 2:
            out["update_weights_host_s"] = _seconds(llm.update_weights, state.items())
        out[f"identical_after_sleep{level}"] = tokens() == expected
    if torch.cuda.is_available() and state:
        on_gpu = {name: t.cuda() for name, t in state.items()}
        out["update_weights_gpu_s"] = _seconds(llm.update_weights, on_gpu.items())
    out["weights_gib"] = sum(t.numel() * t.element_size() for t in state.values()) / GiB
    return out


def memory() -> dict:
    """GiB allocated by torch in this process, and in use on GPU 0 as the driver counts it."""
    if not torch.cuda.is_available():
        return dict(allocated_gib=0.0, device_used_gib=0.0)
    free, total = torch.cuda.mem_get_info()
    return dict(allocated_gib=torch.cuda.memory_allocated() / GiB,
                device_used_gib=(total - free) / GiB)


def _seconds(fn, *args) -> float:
    sync()
    t = perf_counter()
    fn(*args)
    sync()
    return perf_counter() - t
