"""A fresh process on an empty Triton cache: how long LLM() takes, which kernel variants still
compile inside the first timed generate(), and its throughput against a warm run.

python -m benchmarks.cold_compiles [bench.py flags, e.g. --attention-backend triton, --shape]
python -m benchmarks.cold_compiles --ab [ROUNDS] [bench.py flags]

Sets TRITON_CACHE_DIR to a new empty directory unless one is given (it must then be empty).
No untimed generate() runs first: the first timed run is what a user's first call gets. A
variant is named by its kernel and the argument attributes of its specialisation (divisibility
by 16, equal to 1, constants); every one listed is a compile start-up's warm-up missed.

--profile: also each start-up phase's burst of compiles (benchmarks.compile_bursts).

--ab: LLM()'s start-up phases alone, with start-up's kernels compiled ahead through forked
workers (kernels.compile_workers) and on threads alone (NANOVLLM_PARALLEL_COMPILE=threads),
alternated for ROUNDS rounds (default 1), each in a fresh process on its own empty Triton
cache. A kernel a worker compiled under another key than this process is named (compiled
twice: the variants count grows by one).
"""
import argparse
import os
import subprocess
import sys
import tempfile

if not os.environ.get("TRITON_CACHE_DIR"):  # before anything imports triton
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="nanovllm-triton-")

import glob  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402

from benchmarks import cli, workloads  # noqa: E402
from benchmarks.compile_bursts import BurstRecorder  # noqa: E402
from benchmarks.runs import measure, start_engine  # noqa: E402

# bench.py flags this script never reads: refused rather than ignored.
UNREAD = ("--scenario", "--json", "--plot", "--repeats", "--data-parallel-size", "--dp")


def _variants(cache: str) -> set[str]:
    return set(glob.glob(os.path.join(cache, "*", "*.ttir")))


def _describe(path: str) -> str:
    """The kernel's name and the specialisation attributes on its signature line."""
    text = open(path).read()
    head = re.search(r"tt\.func public @(\w+)\((.*?)\)\s*attributes", text, re.S)
    if head is None:
        return os.path.basename(path)
    attrs = re.findall(r"%(\w+): [^,{]*\{([^}]*)\}", head.group(2))
    return f"{head.group(1)} " + " ".join(f"{name}[{a.strip()}]" for name, a in attrs)


def _timed_run(llm, prompts: list, params: list, cache: str, label: str) -> float:
    """One timed generate(); prints its tok/s and the variants that compiled inside it."""
    before = _variants(cache)
    run = measure(llm, prompts, params)
    new = sorted(_variants(cache) - before)
    print(f"{label}: {run['output_tok_s']:,.0f} tok/s, {run['total_s']:.2f} s; "
          f"compiled inside it: {len(new)}")
    for path in new:
        print("  " + _describe(path))
    return run["output_tok_s"]


def _ab(rounds: int, argv: list[str]) -> None:
    """The start-up line of fresh processes, compiling ahead through workers and on threads."""
    for r in range(1, rounds + 1):
        for label, flag in (("workers", "1"), ("threads", "threads")):
            env = dict(os.environ, NANOVLLM_PARALLEL_COMPILE=flag,
                       TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="nanovllm-triton-"))
            proc = subprocess.run([sys.executable, "-m", "benchmarks.cold_compiles",
                                   "--startup-only", *argv], env=env, text=True,
                                  capture_output=True)
            if proc.returncode:
                raise SystemExit(f"the {label} run failed:\n{proc.stderr[-3000:]}")
            line = next(line for line in proc.stdout.splitlines() if line.startswith("LLM()"))
            print(f"round {r} {label}: {line}", flush=True)
            for line in proc.stderr.splitlines():
                if line.startswith(("compiled again", "start-up:")):
                    print(f"  {line}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)  # the rest is bench.py's
    p.add_argument("--ab", type=int, nargs="?", const=1, default=0, metavar="ROUNDS")
    p.add_argument("--startup-only", action="store_true")  # a child of --ab
    p.add_argument("--profile", action="store_true")
    for flag in UNREAD:  # declared here to be refused, abbreviations too
        p.add_argument(flag, nargs="?", default=None, const="")
    own, rest = p.parse_known_args()
    given = [flag for flag in UNREAD if getattr(own, flag[2:].replace("-", "_")) is not None]
    if given:
        p.error(f"{given[0]} is bench.py's and would be ignored here: cold_compiles runs the "
                "standard workload once cold and once warm, and prints its own lines")
    if own.ab:
        if own.profile:
            p.error("--profile prints one start-up's bursts: run it without --ab")
        _ab(own.ab, rest)
        return
    cache = os.environ["TRITON_CACHE_DIR"]
    if _variants(cache):
        raise SystemExit(f"TRITON_CACHE_DIR={cache} is not empty: give an empty directory")
    sys.argv = ["bench.py", *rest]
    args = cli.parse_args()
    args.random_weights = not (args.tiny or args.shape)  # a random 0.6B when no checkpoint
    path = cli.resolve_model(args)
    size = cli.standard_size(args)
    prompts, params = workloads.standard(**size, max_id=workloads.max_token_id(path),
                                         seed=args.seed)
    logging.basicConfig(format="%(message)s")  # start-up's phases, and kernels compiled twice
    logging.getLogger("nanovllm.runner").setLevel(logging.INFO)
    logging.getLogger("nanovllm.kernels").setLevel(logging.INFO)
    recorder = BurstRecorder() if own.profile else None
    if recorder is not None:  # before LLM(): it times start-up's phases and compiles
        recorder.install()
    llm, startup_s = start_engine(path, args)
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in llm.model_runner.startup_s.items())
    print(f"LLM() on an empty Triton cache: {startup_s:.1f} s ({parts}); "
          f"{len(_variants(cache))} variants compiled; backend {llm.config.attention_backend}; "
          f"compile-ahead threads {llm.model_runner.compile_threads}")
    if recorder is not None:
        print(recorder.table(startup_s))
    if own.startup_only:
        llm.shutdown()
        return
    try:
        first = _timed_run(llm, prompts, params, cache, "first run")
        warm = _timed_run(llm, prompts, params, cache, "warm run")
    finally:
        llm.shutdown()
    print(f"first run / warm run: {first / warm:.3f}")


if __name__ == "__main__":
    main()
