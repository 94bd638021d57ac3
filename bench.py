"""Throughput benchmark: upstream nano-vLLM's workload by default (see docs/benchmarks.md)."""
import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time

DEFAULT_MODEL = "~/huggingface/Qwen3-0.6B"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--random-weights", action="store_true",
                   help="use a random checkpoint of Qwen3-0.6B's shape when --model is absent")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash-attn", "triton", "torch"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported")
    p.add_argument("--json", metavar="FILE", help="also write all results as JSON")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke test)")
    return p.parse_args()


def workload(args, vocab_size: int) -> tuple[list[list[int]], list]:
    """256 random prompts and lengths, drawn exactly as upstream's bench.py (seed 0)."""
    from nanovllm import SamplingParams
    random.seed(0)
    max_id = min(10000, vocab_size - 1)  # the tiny smoke-test model has a small vocabulary
    prompts = [[random.randint(0, max_id) for _ in range(random.randint(args.min_input_len,
                                                                       args.max_input_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=random.randint(args.min_output_len, args.max_output_len))
              for _ in range(args.num_seqs)]
    return prompts, params


def resolve_model(args) -> str:
    """The checkpoint to load; builds a random one in a temporary directory when asked to."""
    from nanovllm.utils.checkpoint import build_checkpoint, qwen3_0_6b_random
    path = os.path.expanduser(args.model)
    if args.tiny:
        return build_checkpoint(tempfile.mkdtemp(prefix="nanovllm-tiny-"))
    if os.path.isdir(path):
        return path
    if not args.random_weights:
        raise SystemExit(f"no checkpoint at {path}; pass --random-weights for a random "
                         "Qwen3-0.6B-shaped one (speed with ignore_eos does not depend on weights)")
    return qwen3_0_6b_random()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def run_once(llm, prompts, params) -> dict:
    """One timed generate() of the whole workload, with latency percentiles."""
    import torch
    llm.reset_prefix_cache()  # every repeat prefills from scratch, as the first did
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(o["token_ids"]) for o in outs)
    ttft = [o["metrics"]["ttft_s"] for o in outs]
    tpot = [(o["metrics"]["latency_s"] - o["metrics"]["ttft_s"]) / max(len(o["token_ids"]) - 1, 1)
            for o in outs]
    stats = llm.stats() if hasattr(llm, "stats") else {}
    return dict(output_tokens=out_tokens, prompt_tokens=sum(map(len, prompts)),
                total_s=elapsed, output_tok_s=out_tokens / elapsed,
                ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                tpot_p50_ms=1e3 * percentile(tpot, 50), tpot_p99_ms=1e3 * percentile(tpot, 99),
                **{k: v for k, v in stats.items() if k.endswith("tok_s")})


def environment(args, llm) -> dict:
    import torch
    env = dict(python=platform.python_version(), torch=torch.__version__,
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               attention_backend=llm.model_runner.backend.name, dtype=str(llm.config.torch_dtype),
               cuda_graphs=llm.model_runner.use_cuda_graph,
               kv_blocks=llm.model_runner.num_kvcache_blocks,
               block_size=llm.config.kvcache_block_size)
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       capture_output=True, check=False).stdout.strip()
    except OSError:
        env["commit"] = None
    return env


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    from nanovllm import LLM, SamplingParams
    import_s = time.perf_counter() - t0
    path = resolve_model(args)
    t0 = time.perf_counter()
    llm = LLM(path, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size,
              attention_backend=args.attention_backend)
    startup_s = time.perf_counter() - t0
    prompts, params = workload(args, llm.config.hf_config.vocab_size)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # untimed warm-up
    runs = [run_once(llm, prompts, params) for _ in range(args.repeats)]
    import torch
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    result = dict(command="python " + " ".join(__import__("sys").argv), import_s=import_s,
                  startup_s=startup_s, startup_parts_s=llm.model_runner.startup_s,
                  peak_gpu_gib=peak_gib, runs=runs,
                  median_output_tok_s=statistics.median(r["output_tok_s"] for r in runs),
                  environment=environment(args, llm))
    llm.shutdown()
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def report(result: dict) -> None:
    for i, r in enumerate(result["runs"]):
        print(f"run {i}: {r['output_tokens']} tok in {r['total_s']:.2f}s = "
              f"{r['output_tok_s']:.0f} tok/s | TTFT p50 {r['ttft_p50_s']:.2f}s "
              f"p99 {r['ttft_p99_s']:.2f}s | TPOT p50 {r['tpot_p50_ms']:.1f}ms "
              f"p99 {r['tpot_p99_ms']:.1f}ms")
    env = result["environment"]
    print(f"median output throughput: {result['median_output_tok_s']:.0f} tok/s "
          f"({env['device']}, {env['attention_backend']}, "
          f"{'graphs' if env['cuda_graphs'] else 'eager'}, {env['kv_blocks']} KV blocks, "
          f"peak {result['peak_gpu_gib']:.1f} GiB, import {result['import_s']:.1f}s, "
          f"LLM() {result['startup_s']:.1f}s: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in result["startup_parts_s"].items()) + ")")


if __name__ == "__main__":
    main()
