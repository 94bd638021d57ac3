"""bench.py's command line: its flags (the engine's, the workload's, the scenarios') and the model
they resolve to. benchmarks/cold_compiles takes the same flags."""
import argparse
import functools
import importlib.util
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor

from benchmarks.shapes import SHAPES, WEIGHT_FORMATS, write_shape
from benchmarks.sizes import sizes

BENCH_DOC = """Benchmarks: upstream nano-vLLM's throughput workload by default, and a matrix of
scenarios that each run a variant against its baseline in one process (see README.md,
"Benchmarks")."""
DEFAULT_MODEL = "~/huggingface/Qwen3-0.6B"
SCENARIO_NAMES = ("throughput", "graphs", "prefix-cache", "kv-pressure", "tp", "dp",
                  "long-context", "rl", "structured")
# The standard workload's sizes; the scenarios that run it honour them (and cold_compiles).
WORKLOAD_FLAGS = ("num_seqs", "min_input_len", "max_input_len", "min_output_len",
                  "max_output_len")
STANDARD = ("throughput", "tp", "dp", "rl", "structured")
# Flags a scenario sets itself, so that it would ignore them: refused with it (and with all).
SET_BY = {"enforce_eager": ("graphs",), "tensor_parallel_size": ("tp",),
          "max_model_len": ("long-context",), "repeats": ("long-context", "rl"),
          **{name: tuple(s for s in SCENARIO_NAMES if s not in STANDARD)
             for name in WORKLOAD_FLAGS}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=BENCH_DOC)
    p.add_argument("--scenario", default="throughput", choices=[*SCENARIO_NAMES, "all"],
                   help="what to measure (default: throughput, the standard workload)")
    _model_arguments(p)
    _engine_arguments(p)
    # Sizes of the throughput workload; unset means upstream's (or the smoke sizes with --tiny).
    p.add_argument("--num-seqs", type=int)
    p.add_argument("--min-input-len", type=int)
    p.add_argument("--max-input-len", type=int)
    p.add_argument("--min-output-len", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--seed", type=int, default=0, help="workload seed (upstream's is 0)")
    p.add_argument("--repeats", type=int,
                   help="timed runs per engine; the median is reported (default 1; structured: "
                        "3 rounds, 1 with --tiny)")
    p.add_argument("--json", metavar="FILE", help="also write all results as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw batch size and tok/s over time for every run (needs matplotlib)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random model and small sizes for every scenario (CPU smoke test)")
    args = p.parse_args()
    check_model(p, args)
    check_values(p, args)
    check_scenario(p, args)
    args.structured_rounds = args.repeats or (1 if args.tiny else 3)
    defaults = dict(model=DEFAULT_MODEL, load_format="dummy" if args.shape else "auto",
                    max_model_len=4096, tensor_parallel_size=1,
                    repeats=1)
    for name, value in defaults.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    return args


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """Which checkpoint, or which shape of dummy weights, and its weights' format."""
    p.add_argument("--model", help=f"checkpoint directory (default: {DEFAULT_MODEL})")
    p.add_argument("--random-weights", action="store_true",
                   help="use a random checkpoint of Qwen3-0.6B's shape when --model is absent")
    p.add_argument("--shape", choices=list(SHAPES),
                   help="dummy weights of a named model's shape: only its config.json and a "
                        "small tokenizer are written (implies --load-format dummy)")
    p.add_argument("--weight-format", default="bf16", choices=list(WEIGHT_FORMATS),
                   help="with --shape: the dummy weights' format (fp8-block: Qwen's FP8 "
                        "releases; fp8-channel: llm-compressor's FP8_DYNAMIC)")
    p.add_argument("--load-format", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone")
    p.add_argument("--quantization", choices=["fp8"],
                   help="fp8: quantize a bf16 checkpoint's weights at load (W8A8, per channel)")


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """LLM's keywords the benchmark passes on."""
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-pipeline", action="store_true",
                   help="lockstep engine: read each step's sampled ids before the next is launched")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, help="default 1")
    p.add_argument("--data-parallel-size", "--dp", type=int,
                   help="replicas for the dp scenario (default: the GPUs present / --tp)")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "flash-attn", "triton", "torch"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV cache storage: the model dtype, or float8_e4m3fn")
    p.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction,
                   help="with --kv-cache-dtype fp8: per-layer K/V scales from the warm-up "
                        "(default), or all 1.0")
    p.add_argument("--max-model-len", type=int, help="default 4096")
    p.add_argument("--block-size", type=int, default=256, help="kvcache_block_size")


def check_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One source of weights, and what only applies to it."""
    if args.weight_format != "bf16" and not args.shape:
        p.error("--weight-format needs --shape (a checkpoint's own config.json says its format)")
    given = [flag for flag, on in (("--shape", args.shape), ("--tiny", args.tiny),
                                   ("--model", args.model is not None),
                                   ("--random-weights", args.random_weights)) if on]
    if given and given[0] in ("--shape", "--tiny") and len(given) > 1:
        p.error(f"{given[0]} builds its own checkpoint: {given[1]} would be ignored")
    if args.shape and args.load_format == "auto":
        p.error("--shape writes no weights: it needs --load-format dummy (its default)")
    if args.quantization and args.weight_format != "bf16":
        p.error(f"--quantization {args.quantization} quantizes bf16 weights; --weight-format "
                f"{args.weight_format} already is FP8")
    if args.calculate_kv_scales is not None and args.kv_cache_dtype != "fp8":
        p.error("--calculate-kv-scales needs --kv-cache-dtype fp8 (the only cache with scales)")


def check_values(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Counts at least 1 (--dp at least 2), input and output ranges not empty, writable
    outputs, and matplotlib for --plot: checked here rather than after the runs."""
    for name in (*WORKLOAD_FLAGS, "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} {value} must be at least 1")
    if args.data_parallel_size is not None and args.data_parallel_size < 2:
        p.error(f"--data-parallel-size {args.data_parallel_size}: the dp scenario compares 1 "
                "replica with N >= 2")
    size = standard_size(args)
    for key in ("input_len", "output_len"):
        lo, hi = size[key]
        if lo > hi:
            p.error(f"--min-{key.replace('_', '-')} {lo} exceeds --max-{key.replace('_', '-')} "
                    f"{hi} (unset ones are the workload's defaults)")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            p.error(f"{flag} {path}: no directory {folder!r} to write it in")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install -e '.[plot]'")


def check_scenario(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags the chosen scenario (or one of all) sets itself or never reads."""
    names = SCENARIO_NAMES if args.scenario == "all" else (args.scenario,)
    for name, scenarios in SET_BY.items():
        clash = [s for s in names if s in scenarios]
        if getattr(args, name) not in (None, False) and clash:
            where = f"{clash[0]} (one of all)" if args.scenario == "all" else clash[0]
            p.error(f"--{name.replace('_', '-')} would be ignored by --scenario {where}, "
                    "which sets its own: run that scenario without it")
    if args.data_parallel_size is not None and "dp" not in names:
        p.error(f"--data-parallel-size is used by --scenario dp only, not {args.scenario}")


def standard_size(args: argparse.Namespace) -> dict:
    """The standard workload's sizes with the command line's overrides."""
    size = sizes("throughput", args.tiny)
    for key in ("input_len", "output_len"):
        lo, hi = getattr(args, f"min_{key}"), getattr(args, f"max_{key}")
        size[key] = (lo or size[key][0], hi or size[key][1])
    size["num_seqs"] = args.num_seqs or size["num_seqs"]
    return size


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
