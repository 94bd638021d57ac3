"""bench.py's command line: its flags (the engine's, the workload's, the scenarios') and the model
they resolve to. benchmarks/cold_compiles takes the same flags."""
import argparse
import functools
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor

from benchmarks.shapes import SHAPES, WEIGHT_FORMATS, write_shape

BENCH_DOC = """Benchmarks: upstream nano-vLLM's throughput workload by default, and a matrix of
scenarios that each run a variant against its baseline in one process (see README.md,
"Benchmarks")."""
DEFAULT_MODEL = "~/huggingface/Qwen3-0.6B"
SCENARIO_NAMES = ("throughput", "graphs", "prefix-cache", "kv-pressure", "tp", "dp",
                  "long-context", "rl", "structured")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=BENCH_DOC)
    p.add_argument("--scenario", default="throughput", choices=[*SCENARIO_NAMES, "all"],
                   help="what to measure (default: throughput, the standard workload)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--random-weights", action="store_true",
                   help="use a random checkpoint of Qwen3-0.6B's shape when --model is absent")
    p.add_argument("--shape", choices=list(SHAPES),
                   help="dummy weights of a named model's shape: only its config.json and a "
                        "small tokenizer are written (implies --load-format dummy)")
    p.add_argument("--weight-format", default="bf16", choices=list(WEIGHT_FORMATS),
                   help="with --shape: the dummy weights' format (fp8-block: Qwen's FP8 "
                        "releases; fp8-channel: llm-compressor's FP8_DYNAMIC)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone")
    p.add_argument("--quantization", choices=["fp8"],
                   help="fp8: quantize a bf16 checkpoint's weights at load (W8A8, per channel)")
    # Sizes of the throughput workload; unset means upstream's (or the smoke sizes with --tiny).
    p.add_argument("--num-seqs", type=int)
    p.add_argument("--min-input-len", type=int)
    p.add_argument("--max-input-len", type=int)
    p.add_argument("--min-output-len", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-pipeline", action="store_true",
                   help="lockstep engine: read each step's sampled ids before the next is launched")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "--dp", type=int,
                   help="replicas for the dp scenario (default: the GPUs present / --tp)")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash-attn", "triton", "torch"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV cache storage: the model dtype, or float8_e4m3fn")
    p.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=True,
                   help="fp8: per-layer K/V scales from the warm-up (default), or all 1.0")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=256, help="kvcache_block_size")
    p.add_argument("--seed", type=int, default=0, help="workload seed (upstream's is 0)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per engine; the median is reported")
    p.add_argument("--json", metavar="FILE", help="also write all results as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw batch size and tok/s over time for every run (needs matplotlib)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random model and small sizes for every scenario (CPU smoke test)")
    args = p.parse_args()
    if args.weight_format != "bf16" and not args.shape:
        p.error("--weight-format needs --shape (a checkpoint's own config.json says its format)")
    if args.shape:
        args.load_format = "dummy"
    return args


def resolve_model(args: argparse.Namespace) -> str:
    """The checkpoint to load; builds a random one in a temporary directory when asked to."""
    from benchmarks.random_checkpoints import build_checkpoint, qwen3_0_6b_random
    if args.shape:
        return write_shape(args.shape, tempfile.mkdtemp(prefix=f"nanovllm-{args.shape}-"),
                           args.weight_format)
    path = os.path.expanduser(args.model)
    if os.path.isdir(path) and not args.tiny:
        return path
    if not args.random_weights and not args.tiny:
        raise SystemExit(f"no checkpoint at {path}; pass --random-weights for a random "
                         "Qwen3-0.6B-shaped one (speed with ignore_eos does not depend on weights)")
    # Built in a child process: transformers' model classes then never load here, so the timed
    # start-up pays for what LLM() imports and nothing more.
    build = (functools.partial(build_checkpoint, tempfile.mkdtemp(prefix="nanovllm-tiny-"))
             if args.tiny else qwen3_0_6b_random)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(build).result()
