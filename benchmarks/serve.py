"""Online serving benchmark: `python -m benchmarks.serve [--tiny | --random-weights | --model P]`.

The standard request mix (benchmarks/workloads.py, "throughput") is first run offline, the
ceiling; then a server (`python -m nanovllm.serve`) gets it with Poisson arrivals at each rate
and all at once ("inf"), every response streamed. Reported per rate: output tok/s, TTFT, TPOT
and inter-token latency (ITL) at p50/p95/p99, and goodput: requests per second meeting both
SLOs (default TTFT <= 1 s and TPOT <= 50 ms).
"""
import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.runs import machine_env
from benchmarks.serve_client import run_rate, summarize
from benchmarks.workloads import max_token_id, sizes, standard

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (else --random-weights or --tiny)")
    p.add_argument("--random-weights", action="store_true",
                   help="a random checkpoint of Qwen3-0.6B's shape (bf16)")
    p.add_argument("--tiny", action="store_true", help="tiny model, few requests, CPU (CI)")
    p.add_argument("--rates", default=None,
                   help="requests/s, comma-separated; inf = all at once (default 4,8,16,32,inf; "
                        "--tiny: 8,inf)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds (default 1)")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="seconds (default 0.05)")
    p.add_argument("--engine", default="process",
                   help="where the server runs its engine: process, thread, or both "
                        "comma-separated (each gets its own server, in turn)")
    p.add_argument("--num-requests", type=int, help="requests of the mix (default: its own)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--plot", help="latency percentiles against rate, as a PNG (matplotlib)")
    p.add_argument("--log", help="the server's log (default: a temporary file)")
    return p.parse_args()


def resolve_model(args: argparse.Namespace) -> str:
    from benchmarks.random_checkpoints import build_checkpoint, qwen3_0_6b_random
    if args.tiny:
        return build_checkpoint(tempfile.mkdtemp(prefix="nanovllm-tiny-"))
    if args.model:
        return os.path.expanduser(args.model)
    if args.random_weights:
        return qwen3_0_6b_random()
    raise SystemExit("pass --model PATH, --random-weights or --tiny")


def engine_options(args: argparse.Namespace) -> dict:
    options = dict(max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
    if args.tiny:
        options["device"] = "cpu"
    return options


def offline(path: str, prompts: list, params: list, options: dict) -> dict:
    """The same requests through LLM.generate in this process: the ceiling."""
    import torch

    from nanovllm import LLM, SamplingParams
    llm = LLM(path, **options)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    tokens = sum(len(o["token_ids"]) for o in outs)
    return dict(output_tok_s=tokens / elapsed, duration_s=elapsed, output_tokens=tokens)


def start_server(path: str, options: dict, log_path: str,
                 engine: str) -> tuple[subprocess.Popen, str]:
    """`python -m nanovllm.serve` on a free port; returns once /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        flags += ([flag] if value else []) if isinstance(value, bool) else [flag, str(value)]
    cmd = [sys.executable, "-m", "nanovllm.serve", path, "--port", str(port),
           "--served-model-name", "bench", "--log-level", "warning", *flags,
           "--engine-process" if engine == "process" else "--no-engine-process"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start; its log:\n{Path(log_path).read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(2)  # Ctrl-C: the server's own clean shutdown
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def print_table(rows: dict[str, dict], ceiling: dict) -> None:
    print(f"offline ceiling: {ceiling['output_tok_s']:.0f} output tok/s "
          f"({ceiling['output_tokens']} tokens in {ceiling['duration_s']:.1f} s)")
    print(f"{'rate':>5} {'done':>5} {'tok/s':>7} {'req/s':>6} | {'TTFT ms p50/p95/p99':>20} | "
          f"{'TPOT ms p50/p95/p99':>20} | {'ITL ms p50/p95/p99':>20} | goodput req/s")
    for rate, r in rows.items():
        cols = [f"{r[f'{m}_p50_ms']:.0f}/{r[f'{m}_p95_ms']:.0f}/{r[f'{m}_p99_ms']:.0f}"
                for m in ("ttft", "tpot", "itl")]
        print(f"{rate:>5} {r['completed']:>5} {r['output_tok_s']:>7.0f} {r['request_s']:>6.2f} | "
              f"{cols[0]:>20} | {cols[1]:>20} | {cols[2]:>20} | {r['goodput_req_s']:.2f}")


def plot(rows: dict[str, dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[plot]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    finite = {float(rate): r for rate, r in rows.items() if rate != "inf"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("ttft", "tpot", "itl")):
        for q in (50, 95, 99):
            ax.plot(list(finite), [r[f"{metric}_p{q}_ms"] for r in finite.values()], "o-",
                    label=f"p{q}")
        ax.set(title=metric.upper(), xlabel="request rate (req/s)", ylabel="ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    args = parse_args()
    if args.tiny:  # the smoke model's ops are tiny: more threads only contend on a shared box
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch
        torch.set_num_threads(1)
    rates = args.rates or ("8,inf" if args.tiny else "4,8,16,32,inf")
    path, options = resolve_model(args), engine_options(args)
    mix = sizes("throughput", args.tiny)
    mix["num_seqs"] = args.num_requests or mix["num_seqs"]
    prompts, params = standard(**mix, max_id=max_token_id(path), seed=args.seed)
    ceiling = offline(path, prompts, params, options)
    engines = {engine: serve(args, path, options, engine, prompts, params, rates)
               for engine in args.engine.split(",")}
    for engine, (rows, _) in engines.items():
        print(f"engine in a {engine}:")
        print_table(rows, ceiling)
    result = dict(environment=machine_env(args), offline=ceiling,
                  engines={engine: rows for engine, (rows, _) in engines.items()},
                  num_requests=len(prompts),
                  slo=dict(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot), engine=options,
                  command="python -m benchmarks.serve " + " ".join(sys.argv[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(next(iter(engines.values()))[0], args.plot)
    for engine, (rows, exit_code) in engines.items():
        failed = sum(r["failed"] for r in rows.values())
        if failed or exit_code != 0:
            raise SystemExit(f"engine in a {engine}: {failed} requests failed; server exit "
                             f"code {exit_code}")


def serve(args: argparse.Namespace, path: str, options: dict, engine: str, prompts: list,
          params: list, rates: str) -> tuple[dict[str, dict], int]:
    """Every rate through one server; returns (figures per rate, the server's exit code)."""
    log_path = args.log or tempfile.mktemp(prefix=f"nanovllm-serve-{engine}-", suffix=".log")
    proc, url = start_server(path, options, log_path, engine)
    rows = {}
    try:
        max_tokens = [p.max_tokens for p in params]
        asyncio.run(run_rate(url, "bench", prompts[:2], [4, 4], 0.6, float("inf"), 0))  # warm
        for rate in rates.split(","):
            timings, duration = asyncio.run(run_rate(url, "bench", prompts, max_tokens,
                                                     params[0].temperature, float(rate),
                                                     args.seed))
            rows[rate] = summarize(timings, duration, args.slo_ttft, args.slo_tpot)
            print(f"{engine} rate {rate}: {rows[rate]['output_tok_s']:.0f} tok/s", flush=True)
    finally:
        stop_server(proc)
    print(f"server log ({engine}): {log_path}")
    return rows, proc.returncode


if __name__ == "__main__":
    main()
