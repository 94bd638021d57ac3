"""Sweep the fused MoE kernel's launch configurations on Qwen3-30B-A3B's per-rank shape (GPU):

    python -m benchmarks.moe_sweep [--quick] [--out sweep.json] [--write-tables bf16 ...]

bf16 experts and 128 x 128 block-scaled FP8 experts, at 1 to 8,192 tokens: every configuration
of the grid is timed (CUDA-graph replays, L2 flushed before each, so that neither the host's
launches nor a warm cache hide the kernels) and checked against the default's output. Prints
the default and the fastest correct configuration per token count; --write-tables writes those
as kernels/moe/configs/<shape>.json for the weight kinds named, keyed by slots (tokens x
top_k). A table ships only where an alternated end-to-end run shows it pays (docs/benchmarks.md).
--dry-run lists the grid (no CUDA).
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time

from nanovllm.kernels.moe.config import CONFIG_DIR, MoEConfig, shape_key

E, H, INTER, TOP_K = 128, 2048, 768, 8  # Qwen3-30B-A3B, one rank
TOKENS = [1, 8, 32, 128, 256, 512, 2048, 8192]
MODES = ("bf16", "fp8")
WARMUP, TIMED, TOL = 3, 20, 2e-2


def grid(mode: str, tokens: int, quick: bool) -> list[MoEConfig]:
    """The configurations timed for one mode and token count (the default always among them)."""
    fp8 = mode != "bf16"
    block_ms = [m for m in (16, 32, 64) if (m != 64 or tokens >= 2048) and
                (m != 16 or tokens <= 512)]
    block_ks = (128,) if fp8 else (64, 128)
    warps = (4,) if quick else (4, 8)
    stages = (3, 4) if quick else (2, 3, 4, 5)
    configs = [MoEConfig(*c) for c in itertools.product(block_ms, (64, 128), block_ks, warps,
                                                        stages)]
    # decode: 32-wide column tiles give the few experts' slots twice the programs (at one
    # token 96 programs of 64 columns run on 132 SMs), and room for more stages
    if tokens <= 32:
        configs += [MoEConfig(*c) for c in itertools.product(
            block_ms, (32,), block_ks, warps, stages + (() if quick else (6, 8)))]
    return list(dict.fromkeys([default_for(mode, tokens)] + configs))


def default_for(mode: str, tokens: int) -> MoEConfig:
    """What fused_moe launches with no table entry."""
    from nanovllm.kernels.moe.config import default_config
    return default_config(tokens * TOP_K, E, mode != "bf16")


def dry_run(quick: bool) -> None:
    """List every configuration the sweep would time; touches no GPU."""
    total, variants = 0, set()
    for mode, tokens in itertools.product(MODES, TOKENS):
        configs = grid(mode, tokens, quick)
        total += len(configs)
        variants.update((mode, c) for c in configs)
        print(f"{mode:10s} {tokens:5d} tokens: {len(configs):3d} configs  default "
              f"{tuple(default_for(mode, tokens))}")
        for c in configs:
            print("    " + " ".join(f"{k}={v}" for k, v in c._asdict().items()))
    print(f"{total} timings of {len(variants)} kernel configurations")


def build_weights(torch, quantize_groups) -> dict:
    """bf16 experts (scale 0.02) and their 128 x 128 block-scaled FP8 codes, on cuda."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, INTER, device="cuda", generator=g) * 0.02).bfloat16()
    fp8 = []
    for w in (w13, w2):
        codes, scales = zip(*(quantize_groups(e, 128, 128) for e in w))
        fp8 += [torch.stack(codes), torch.stack(scales)]
    return {"bf16": (w13, w2), "fp8": tuple(fp8)}


def inputs(torch, select_experts, tokens: int) -> tuple:
    """(x, topk_weights, topk_ids) of uniformly random router logits."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, E, device="cuda", generator=g).bfloat16()
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    return x, weights, ids


def call_for(fused_moe, weights: dict, mode: str, x, topk_weights, topk_ids, config):
    """A no-argument call of fused_moe in this mode and configuration."""
    if mode == "bf16":
        w13, w2 = weights["bf16"]
        return lambda: fused_moe(x, w13, w2, topk_weights, topk_ids, config=config)
    w13, w13_s, w2, w2_s = weights["fp8"]
    return lambda: fused_moe(x, w13, w2, topk_weights, topk_ids, w13_s, w2_s, (128, 128),
                             config=config)


def time_call(torch, call, flush) -> tuple[float, object]:
    """(median µs of TIMED graph replays of call, its output) after WARMUP eager calls."""
    for _ in range(WARMUP):
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(WARMUP):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(TIMED)]
    for start, end in events:
        flush.zero_()  # evict the experts from L2, as the other layers of a step do
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    us = statistics.median(s.elapsed_time(e) * 1000.0 for s, e in events)
    result = out.clone()
    del graph
    return us, result


def precompile(torch, fused_moe, select_experts, weights: dict, quick: bool) -> float:
    """Compile every swept kernel variant on a thread pool first (variants do not depend on the
    token count); returns seconds. A failing compile is left to the timing loop to record."""
    from nanovllm.kernels.compile_ahead import compile_in_parallel
    start = time.time()
    x, tw, ti = inputs(torch, select_experts, 256)
    steps = []
    for mode in MODES:
        configs = dict.fromkeys(c for t in TOKENS for c in grid(mode, t, quick))
        for config in configs:
            call = call_for(fused_moe, weights, mode, x, tw, ti, config)
            steps.append(call)
    try:
        compile_in_parallel(steps, min(32, os.cpu_count() or 1))
    except Exception as e:  # noqa: BLE001 - the timing loop compiles and records it
        print(f"parallel compile stopped: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()
    return time.time() - start


def sweep(args) -> None:
    import torch

    from nanovllm.kernels.linear.fp8_reference import quantize_groups
    from nanovllm.kernels.moe.fused_moe import fused_moe
    from nanovllm.kernels.moe.routing import select_experts
    start = time.time()
    weights = build_weights(torch, quantize_groups)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    compile_s = precompile(torch, fused_moe, select_experts, weights, args.quick)
    print(f"compiled in {compile_s:.0f} s", flush=True)
    records, summary = [], []
    for tokens in TOKENS:
        x, tw, ti = inputs(torch, select_experts, tokens)
        for mode in MODES:
            default = default_for(mode, tokens)
            ref, rows, failed = None, [], 0
            for config in grid(mode, tokens, args.quick):  # the default first
                rec = dict(mode=mode, tokens=tokens, config=config._asdict(),
                           default=config == default)
                try:
                    us, out = time_call(torch, call_for(fused_moe, weights, mode, x, tw, ti,
                                                        config), flush)
                except Exception as e:  # noqa: BLE001 - compile errors, shared memory, ...
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    torch.cuda.synchronize()
                    records.append(rec)
                    failed += 1
                    continue
                if ref is None:
                    ref = out
                diff = ((out.float() - ref.float()).abs().max() /
                        ref.float().abs().max().clamp(min=1e-30)).item()
                rec.update(us=us, rel_diff=diff, ok=diff < TOL)
                records.append(rec)
                rows.append(rec)
            summary.append(summarize(mode, tokens, rows, failed))
            print(format_row(summary[-1]), flush=True)
    report(args, records, summary, time.time() - start, compile_s)


def summarize(mode: str, tokens: int, rows: list[dict], failed: int) -> dict:
    """Default and best (correct) timing of one mode and token count."""
    ok = [r for r in rows if r["ok"]]
    default = next((r for r in rows if r["default"]), None)
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return dict(mode=mode, tokens=tokens, default_us=default and default["us"],
                best_us=best and best["us"], best=best and best["config"],
                timed=len(rows), wrong=len(rows) - len(ok), failed=failed)


def format_row(s: dict) -> str:
    if s["best_us"] is None or s["default_us"] is None:
        return f"{s['mode']:10s} {s['tokens']:5d}  (no default or no correct timing)"
    c = s["best"]
    cfg = f"m{c['block_m']} n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']}"
    return (f"{s['mode']:10s} {s['tokens']:5d} {s['default_us']:9.1f} {s['best_us']:9.1f}  "
            f"{cfg:22s} {s['default_us'] / s['best_us']:6.2f}x {s['wrong']:5d} {s['failed']:6d}")


def report(args, records: list, summary: list, elapsed: float, compile_s: float) -> None:
    """Write the raw timings and the tables asked for, then print the table."""
    with open(args.out, "w") as f:
        json.dump(dict(shape=dict(E=E, H=H, I=INTER, top_k=TOP_K), quick=args.quick,
                       elapsed_s=elapsed, compile_s=compile_s, summary=summary,
                       records=records), f, indent=1)
    for kind in args.write_tables:
        print("wrote", write_table(summary, kind, CONFIG_DIR))
    errors = sum("error" in r for r in records)
    print(f"\nelapsed {elapsed:.0f} s (compile {compile_s:.0f} s); {len(records)} timings, "
          f"{errors} failed to run; raw timings in {args.out}")
    print(f"{'mode':10s} {'tok':>5s} {'dflt µs':>9s} {'best µs':>9s}  {'best config':22s} "
          f"{'speedup':>7s} {'wrong':>5s} {'failed':>6s}")
    for s in summary:
        print(format_row(s))


def write_table(summary: list, kind: str, config_dir) -> str:
    """The fastest correct configuration per token count of one weight kind, as the JSON table
    kernels.moe.config loads, keyed by slots (tokens x top_k); returns its path."""
    configs = {str(s["tokens"] * TOP_K): list(s["best"].values())
               for s in summary if s["mode"] == kind and s["best"] is not None}
    path = os.path.join(config_dir, shape_key(E, H, INTER, kind == "fp8") + ".json")
    rows = ",\n".join(f'  "{slots}": {json.dumps(c)}' for slots, c in configs.items())
    with open(path, "w") as f:
        f.write(f'{{"measured_on": "{gpu_name()}", "date": "{time.strftime("%Y-%m-%d")}", '
                f'"by": "python -m benchmarks.moe_sweep",\n "configs": {{\n{rows}\n }}}}\n')
    return path


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="moesweep.json", help="raw timings (JSON)")
    parser.add_argument("--quick", action="store_true", help="a quarter of the grid")
    parser.add_argument("--dry-run", action="store_true", help="list the grid; no CUDA")
    parser.add_argument("--write-tables", nargs="*", default=[], choices=MODES,
                        help="write the fastest configurations of these kinds as tables")
    args = parser.parse_args()
    if args.dry_run:
        dry_run(args.quick)
        return
    sweep(args)


if __name__ == "__main__":
    sys.exit(main())
