"""What every scenario shares: one engine at a time, a timed generate(), the environment."""
import argparse
import gc
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter

import torch

GiB = 2**30


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by rank (no interpolation); 0.0 for no values."""
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def start_engine(path: str, args: argparse.Namespace, **overrides) -> tuple:
    """(LLM, seconds LLM() took), built from the command line's flags plus `overrides`."""
    from nanovllm import LLM
    t0 = perf_counter()
    llm = LLM(path, **{**engine_kwargs(args), **overrides})
    startup_s = perf_counter() - t0
    if getattr(args, "no_pipeline", False):
        llm._pipelined = False  # the engine's private switch, to measure what pipelining gives
    return llm, startup_s


@contextmanager
def open_engine(path: str, args: argparse.Namespace, **overrides) -> Iterator[tuple]:
    """(LLM, seconds LLM() took), built from the command line's flags plus `overrides`, warmed
    up by one untimed generate() and shut down on exit.

    Two engines at gpu_memory_utilization=0.9 cannot coexist, so scenarios open their
    baseline and variant one after the other; shutdown frees the KV pool and the graphs.
    """
    from nanovllm import SamplingParams
    llm, startup_s = start_engine(path, args, **overrides)
    try:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # untimed warm-up
        yield llm, startup_s
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM()'s keywords from bench.py's engine flags."""
    return dict(enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
                tensor_parallel_size=args.tensor_parallel_size,
                kvcache_block_size=args.block_size, attention_backend=args.attention_backend,
                load_format=getattr(args, "load_format", "auto"),
                kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                calculate_kv_scales=getattr(args, "calculate_kv_scales", None),
                quantization=getattr(args, "quantization", None))


def measure(llm, prompts: list[list[int]], params: list, outputs: list | None = None) -> dict:
    """One timed generate() from an empty prefix cache: totals, latencies, engine counters;
    the outputs themselves are appended to `outputs` when given."""
    llm.reset_prefix_cache()  # every run prefills from scratch, as the first did
    llm.reset_stats(timeline=True)
    sync()
    t = perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = perf_counter() - t
    if outputs is not None:
        outputs.extend(outs)
    out_tokens = sum(len(o["token_ids"]) for o in outs)
    ttft = [o["metrics"]["ttft_s"] for o in outs]
    tpot = [(o["metrics"]["latency_s"] - o["metrics"]["ttft_s"]) / max(len(o["token_ids"]) - 1, 1)
            for o in outs]
    stats = llm.stats()
    timeline = stats.pop("timeline")
    return dict(output_tokens=out_tokens, prompt_tokens=sum(map(len, prompts)),
                total_s=elapsed, output_tok_s=out_tokens / elapsed,
                ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                tpot_p50_ms=1e3 * percentile(tpot, 50), tpot_p99_ms=1e3 * percentile(tpot, 99),
                **stats, timeline=[list(entry) for entry in timeline])


def engine_env(llm, startup_s: float) -> dict:
    """The engine's side of the conditions: backend, dtype, graphs, block size, KV pool."""
    runner, config = llm.model_runner, llm.config
    quant = config.quant_config
    return dict(attention_backend=runner.backend.name, dtype=str(config.torch_dtype),
                weights=quant.method if quant is not None else "unquantized",
                kv_cache_dtype=str(config.kv_cache_torch_dtype),
                cuda_graphs=runner.use_cuda_graph, enforce_eager=config.enforce_eager,
                tensor_parallel_size=config.tensor_parallel_size,
                block_size=config.kvcache_block_size, kv_blocks=runner.num_kvcache_blocks,
                max_model_len=config.max_model_len, pipelined=llm._pipelined,
                startup_s=startup_s,
                startup_parts_s=dict(getattr(runner, "startup_s", {})),
                fused_limits=dict(getattr(runner, "fused_limits", {})))


def machine_env(args: argparse.Namespace) -> dict:
    """The machine's side: GPU model and count, library versions, commit, command, seed."""
    cuda = torch.cuda.is_available()
    return dict(device=torch.cuda.get_device_name() if cuda else "cpu",
                gpu_count=torch.cuda.device_count() if cuda else 0,
                python=platform.python_version(), torch=torch.__version__,
                triton=_version("triton"), flash_attn=_version("flash_attn"),
                commit=commit(), command="python " + " ".join(sys.argv), seed=args.seed,
                tiny=args.tiny)


def _version(module: str) -> str | None:
    """A module's __version__, or None when it cannot be imported."""
    try:
        return getattr(__import__(module), "__version__", "unknown")
    except ImportError:
        return None


def commit() -> str | None:
    """HEAD's short hash; NANOVLLM_COMMIT where the tree travelled without .git (GPU machine)."""
    if os.environ.get("NANOVLLM_COMMIT"):
        return os.environ["NANOVLLM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                             capture_output=True, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


class GpuWaitProbe:
    """Times how long the host waits for the GPU in each step, by wrapping the runner's sampler.

    The sampled ids are copied to the host right after the sampler, so a synchronize placed
    there blocks exactly where the step would block anyway: host time per step is then the
    step's wall time minus this wait (on CPU the wait is 0 and host time is the wall time).
    """

    def __init__(self, runner):
        self.waits: list[float] = []
        self.cuda = torch.cuda.is_available()
        self.runner, self.sampler = runner, runner.sampler
        runner.sampler = self

    def __call__(self, *args, **kwargs):
        out = self.sampler(*args, **kwargs)
        if not self.cuda:
            self.waits.append(0.0)
            return out
        t = perf_counter()
        torch.cuda.synchronize()
        self.waits.append(perf_counter() - t)
        return out

    def remove(self) -> None:
        self.runner.sampler = self.sampler


def host_times(timeline: list[list], waits: list[float]) -> dict:
    """Mean ms per decode step: wall, GPU wait, and host (wall minus wait); see GpuWaitProbe."""
    decode = [(entry[1], wait) for entry, wait in zip(timeline, waits) if not entry[2]]
    if not decode:
        return dict(step_ms=0.0, gpu_wait_ms=0.0, host_ms=0.0)
    wall = 1e3 * sum(w for w, _ in decode) / len(decode)
    wait = 1e3 * sum(g for _, g in decode) / len(decode)
    return dict(step_ms=wall, gpu_wait_ms=wait, host_ms=wall - wait)


def print_table(title: str, rows: dict[str, dict], columns: list[tuple[str, str, str]]) -> None:
    """Rows by label; columns as (key, header, format spec); missing values print as '-'."""
    headers = ["run"] + [header for _, header, _ in columns]
    lines = [[label] + [format(row[key], spec) if row.get(key) is not None else "-"
                        for key, _, spec in columns] for label, row in rows.items()]
    widths = [max(len(x) for x in col) for col in zip(headers, *lines)]
    print(f"\n== {title}")
    for line in [headers] + lines:
        print("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in
                        enumerate(zip(line, widths))))
