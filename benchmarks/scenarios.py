"""The benchmark matrix: each scenario runs a variant against its baseline in one process."""
import argparse
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import replace

import torch

from benchmarks import workloads
from benchmarks.cli import standard_size
from benchmarks.rl import rl
from benchmarks.runs import (
    GiB,
    GpuWaitProbe,
    engine_env,
    host_times,
    measure,
    open_engine,
    percentile,
)
from benchmarks.structured import structured

Scenario = Callable[[argparse.Namespace, str], dict]


def repeated(llm, prompts: list, params: list, repeats: int) -> dict:
    """`repeats` timed runs on one engine; the median run by output tok/s, with all of them."""
    runs = [measure(llm, prompts, params) for _ in range(repeats)]
    median = sorted(runs, key=lambda r: r["output_tok_s"])[(len(runs) - 1) // 2]
    return dict(median, repeat_output_tok_s=[r["output_tok_s"] for r in runs])


def host_split(llm, prompts: list, params: list) -> dict:
    """ms per decode step split into GPU wait and host time, from one extra lockstep run.

    The probe synchronises after every step, which would stall the pipelined engine, so this
    run is lockstep (see LLMEngine.step) and separate from the timed runs.
    """
    probe, pipelined, llm._pipelined = GpuWaitProbe(llm.model_runner), llm._pipelined, False
    try:
        run = measure(llm, prompts, params)
    finally:
        probe.remove()
        llm._pipelined = pipelined
    return host_times(run["timeline"], probe.waits)


def throughput(args: argparse.Namespace, path: str) -> dict:
    """Upstream's workload, as bench.py has always run it (--repeats timed runs, one engine)."""
    size = standard_size(args)
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path),
                                         seed=args.seed)
    with open_engine(path, args) as (llm, startup_s):
        runs = [measure(llm, prompts, params) for _ in range(args.repeats)]
        peak_gib = torch.cuda.max_memory_allocated() / GiB if torch.cuda.is_available() else 0.0
        env = engine_env(llm, startup_s)
    return dict(workload=size, startup_s=startup_s, startup_parts_s=env["startup_parts_s"],
                peak_gpu_gib=peak_gib, runs=runs,
                median_output_tok_s=statistics.median(r["output_tok_s"] for r in runs),
                engine=env)


def graphs(args: argparse.Namespace, path: str) -> dict:
    """enforce_eager=True vs CUDA graphs on a decode-heavy workload."""
    size = workloads.sizes("graphs", args.tiny)
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path),
                                         seed=args.seed)
    runs = {}
    for label, eager in (("eager", True), ("graphs", False)):
        with open_engine(path, args, enforce_eager=eager) as (llm, startup_s):
            runs[label] = repeated(llm, prompts, params, args.repeats)
            short = [replace(p, max_tokens=128) for p in params[:32]]
            runs[label].update(host_split(llm, prompts[:32], short))
            runs[label]["engine"] = engine_env(llm, startup_s)
    note = None if runs["graphs"]["engine"]["cuda_graphs"] else "no CUDA: both runs are eager"
    return dict(workload=size, runs=runs, note=note,
                decode_speedup=_ratio(runs["graphs"], runs["eager"], "decode_tok_s"),
                host_time_ratio=_ratio(runs["eager"], runs["graphs"], "host_ms"))


def prefix_cache(args: argparse.Namespace, path: str) -> dict:
    """Requests sharing one whole-block system prompt vs the same requests with distinct ones."""
    size = workloads.sizes("prefix-cache", args.tiny)
    max_id, block_size, runs = workloads.max_token_id(path), args.block_size, {}
    with open_engine(path, args) as (llm, startup_s):  # one engine: only the prompts differ
        for label, shared in (("distinct", False), ("shared", True)):
            prompts, params = workloads.shared_prefix(**size, block_size=block_size,
                                                      max_id=max_id, seed=args.seed,
                                                      shared=shared)
            run = repeated(llm, prompts, params, args.repeats)
            full_blocks = sum(len(p) // block_size for p in prompts)
            run.update(full_prompt_blocks=full_blocks,
                       hit_rate=run["cache_hit_blocks"] / full_blocks,
                       engine=engine_env(llm, startup_s))
            runs[label] = run
    return dict(workload=size, runs=runs,
                prefill_speedup=_ratio(runs["distinct"], runs["shared"], "prefill_s"))


def kv_pressure(args: argparse.Namespace, path: str) -> dict:
    """Long concurrent sequences in a pool holding a fraction of their peak need vs the
    unconstrained (auto-sized) pool."""
    size = workloads.sizes("kv-pressure", args.tiny)
    fraction = size.pop("pool_fraction")
    prompts, params = workloads.fixed_lengths(**size, max_id=workloads.max_token_id(path),
                                              seed=args.seed)
    per_seq = workloads.peak_blocks(size["input_len"] + size["output_len"], args.block_size)
    pool = max(per_seq, int(fraction * per_seq * size["num_seqs"]))
    runs = {}
    for label, overrides in (("unconstrained", {}), ("small-pool", dict(num_kvcache_blocks=pool))):
        with open_engine(path, args, **overrides) as (llm, startup_s):
            runs[label] = repeated(llm, prompts, params, args.repeats)
            runs[label]["engine"] = engine_env(llm, startup_s)
    need = per_seq * len(prompts)
    return dict(workload=dict(size, pool_fraction=fraction, peak_need_blocks=need,
                              pool_blocks=pool), runs=runs,
                slowdown=_ratio(runs["small-pool"], runs["unconstrained"], "total_s"))


def long_context(args: argparse.Namespace, path: str) -> dict:
    """A few long prompts after the standard requests: prefilled in one step each (a budget
    that holds a whole prompt, as before chunking) vs in chunks of the default budget, with a
    decode step after each chunk. TTFT of the long prompts; TPOT of the standard ones and the
    longest pause between decode steps (what a decoding request waits at worst)."""
    size = workloads.sizes("long-context", args.tiny)
    budget = size.pop("budget")
    prompts, params = workloads.long_context(**size, max_id=workloads.max_token_id(path),
                                             seed=args.seed)
    max_model_len = size["long_input_len"] + size["long_output_len"]
    runs, num_long = {}, size["num_long"]
    for label, batched in (("one-step", max_model_len), ("chunked", budget)):
        with open_engine(path, args, max_model_len=max_model_len,
                         max_num_batched_tokens=batched) as (llm, startup_s):
            outs: list[dict] = []
            run = measure(llm, prompts, params, outs)
            tpot = [(o["metrics"]["latency_s"] - o["metrics"]["ttft_s"])
                    / max(len(o["token_ids"]) - 1, 1) for o in outs[:-num_long]]
            run.update(long_ttft_s=[o["metrics"]["ttft_s"] for o in outs[-num_long:]],
                       short_tpot_p50_ms=1e3 * percentile(tpot, 50),
                       short_tpot_p99_ms=1e3 * percentile(tpot, 99),
                       max_decode_gap_ms=1e3 * _max_decode_gap(run["timeline"]),
                       max_num_batched_tokens=batched, engine=engine_env(llm, startup_s))
            runs[label] = run
    return dict(workload=dict(size, budget=budget), runs=runs,
                max_gap_ratio=_ratio(runs["one-step"], runs["chunked"], "max_decode_gap_ms"))


def _max_decode_gap(timeline: list) -> float:
    """Longest time between the end of one decode step and the start of the next."""
    decodes = [(start, dur) for start, dur, is_prefill, *_ in timeline if not is_prefill]
    return max((b[0] - a[0] - a[1] for a, b in zip(decodes, decodes[1:])), default=0.0)


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return a[key] / b[key] if b.get(key) else None


def tp(args: argparse.Namespace, path: str) -> dict:
    """tensor_parallel_size 1 vs every valid larger size on this machine, on the standard
    workload: tok/s, scaling efficiency, memory per GPU."""
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus < 2:
        return dict(skipped=f"tensor parallelism needs 2 or more CUDA GPUs; found {num_gpus}")
    heads = workloads.head_counts(path)
    sizes = [n for n in (1, 2, 4, 8) if n <= num_gpus and all(h % n == 0 for h in heads)]
    size = standard_size(args)
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path),
                                         seed=args.seed)
    runs: dict[str, dict] = {}
    for n in sizes:
        try:
            with open_engine(path, args, tensor_parallel_size=n) as (llm, startup_s):
                _check_ranks(n)
                run = repeated(llm, prompts, params, args.repeats)
                run.update(_gpu_memory(llm, n), engine=engine_env(llm, startup_s))
        except (RuntimeError, ValueError, NotImplementedError) as e:
            # One size failing (no TP support, out of memory) still reports the others.
            run = dict(error=f"{type(e).__name__}: {e}")
        runs[f"tp={n}"] = run
    base = runs["tp=1"].get("output_tok_s")
    for n in sizes:
        run = runs[f"tp={n}"]
        if base and "output_tok_s" in run:
            run["speedup"] = run["output_tok_s"] / base
            run["scaling_efficiency"] = run["speedup"] / n
    return dict(workload=size, sizes=sizes, runs=runs)


def dp(args: argparse.Namespace, path: str) -> dict:
    """data_parallel_size 1 vs N (--dp, else the GPUs present / tensor_parallel_size) on the
    standard workload scaled to N x its requests: tok/s, speedup and per-replica balance."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = args.data_parallel_size or gpus // args.tensor_parallel_size
    if n < 2:
        return dict(skipped=f"data parallelism needs 2 or more replicas; found {gpus} CUDA "
                            f"GPU(s) for tensor_parallel_size={args.tensor_parallel_size} "
                            "(or pass --dp N)")
    size = standard_size(args)
    size["num_seqs"] *= n
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path),
                                         seed=args.seed)
    runs: dict[str, dict] = {}
    # DP=N first: its replicas then size their KV pools before this process touches a GPU.
    for size_n in (n, 1):
        with open_engine(path, args, data_parallel_size=size_n) as (llm, startup_s):
            # One untimed pass of the workload: DP=N runs first, and its timed run would
            # otherwise pay alone for the JIT compiles and first calls that DP=1 then reuses.
            measure(llm, prompts, params)
            run = repeated(llm, prompts, params, args.repeats)
            run["engine"] = (engine_env(llm, startup_s) if size_n == 1 else
                             dict(data_parallel_size=size_n, startup_s=startup_s))
            run.update(_balance(run.get("replicas", [run])))
        runs[f"dp={size_n}"] = run
    base = runs["dp=1"]["output_tok_s"]
    for run in runs.values():
        run["speedup"] = run["output_tok_s"] / base
    return dict(workload=size, data_parallel_size=n, runs=dict(reversed(runs.items())))


def _balance(replicas: list[dict]) -> dict:
    """Each replica's tokens computed and busy seconds; balance = least busy / most busy."""
    busy = [r["prefill_s"] + r["decode_s"] for r in replicas]
    tokens = [r["prefill_tokens"] + r["decode_tokens"] for r in replicas]
    return dict(replica_tokens=tokens, replica_busy_s=busy,
                balance=min(busy) / max(busy) if max(busy) else None)


def _check_ranks(n: int) -> None:
    """An engine without tensor-parallel workers would run tp=n on one GPU: refuse to time it."""
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks != n:
        raise RuntimeError(f"tensor_parallel_size={n} but the engine runs {ranks} rank(s): "
                           "this build has no tensor-parallel workers")


def _gpu_memory(llm, num_gpus: int) -> dict:
    """Rank 0's weights and KV pool (every rank holds the same shapes), and what each GPU has
    in use in all (any process, from the driver, read before shutdown)."""
    runner = llm.model_runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = runner.kv_cache.numel() * runner.kv_cache.element_size()
    used = _driver_used_gib()[:num_gpus]
    return dict(weights_gib_per_gpu=weights / GiB, kv_pool_gib_per_gpu=kv / GiB,
                peak_allocated_gib_rank0=torch.cuda.max_memory_allocated() / GiB,
                gpu_used_gib=used)


def _driver_used_gib() -> list[float]:
    """Memory in use on each GPU as the driver sees it (nvidia-smi: no CUDA context needed,
    so reading it does not itself take memory on the workers' GPUs); [] when unavailable."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], text=True,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [int(line) / 1024 for line in out.split()]  # MiB -> GiB


SCENARIOS: dict[str, Scenario] = {"throughput": throughput, "graphs": graphs,
                                  "prefix-cache": prefix_cache, "kv-pressure": kv_pressure,
                                  "tp": tp, "dp": dp, "long-context": long_context, "rl": rl,
                                  "structured": structured}
