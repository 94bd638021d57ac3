"""Compact tables of the scenarios' results (what --json writes in full)."""
from benchmarks.runs import print_table

Columns = list[tuple[str, str, str]]

GRAPHS: Columns = [("decode_tok_s", "decode tok/s", ".0f"), ("tpot_p50_ms", "TPOT p50 ms", ".2f"),
                   ("tpot_p99_ms", "TPOT p99 ms", ".2f"), ("step_ms", "lockstep step ms", ".2f"),
                   ("host_ms", "host ms/step", ".2f"), ("gpu_wait_ms", "GPU wait ms", ".2f"),
                   ("output_tok_s", "out tok/s", ".0f"), ("total_s", "total s", ".2f")]
PREFIX: Columns = [("prefill_s", "prefill s", ".3f"), ("prefill_tokens", "prefilled tok", "d"),
                   ("cache_hit_blocks", "hit blocks", "d"), ("hit_rate", "hit rate", ".1%"),
                   ("peak_kv_blocks_in_use", "peak KV blocks", "d"),
                   ("ttft_p50_s", "TTFT p50 s", ".3f"), ("total_s", "total s", ".2f")]
KV: Columns = [("kv_blocks", "pool blocks", "d"), ("total_s", "completion s", ".2f"),
               ("output_tok_s", "out tok/s", ".0f"), ("preemptions", "preemptions", "d"),
               ("recomputed_tokens", "recomputed tok", "d"),
               ("peak_kv_blocks_in_use", "peak KV blocks", "d"),
               ("decode_steps", "decode steps", "d"), ("mean_batch", "mean batch", ".1f")]
TP: Columns = [("output_tok_s", "out tok/s", ".0f"), ("speedup", "speedup", ".2f"),
               ("scaling_efficiency", "efficiency", ".0%"),
               ("weights_gib_per_gpu", "weights GiB/GPU", ".2f"),
               ("kv_pool_gib_per_gpu", "KV GiB/GPU", ".1f"), ("used", "used GiB per GPU", "s"),
               ("error", "error", "s")]
RL: Columns = [("output_tok_s", "out tok/s", ".0f"), ("total_s", "total s", ".2f"),
               ("time_vs_plain", "time vs plain", ".2f"), ("completions", "completions", "d"),
               ("prefill_tokens", "prefilled tok", "d"), ("cache_hit_blocks", "hit blocks", "d"),
               ("preemptions", "preemptions", "d")]

DP: Columns = [("output_tok_s", "out tok/s", ".0f"), ("speedup", "speedup", ".2f"),
               ("total_s", "total s", ".2f"), ("tokens", "tokens per replica", "s"),
               ("busy", "busy s per replica", "s"), ("balance", "balance", ".0%"),
               ("startup_s", "LLM() s", ".1f")]

LONG: Columns = [("max_num_batched_tokens", "token budget", "d"), ("long_ttft", "long TTFT s", "s"),
                 ("short_tpot_p50_ms", "short TPOT p50 ms", ".1f"),
                 ("short_tpot_p99_ms", "short TPOT p99 ms", ".1f"),
                 ("max_decode_gap_ms", "max decode gap ms", ".0f"),
                 ("prefill_steps", "prefill steps", "d"), ("output_tok_s", "out tok/s", ".0f"),
                 ("total_s", "total s", ".2f")]

STRUCTURED: Columns = [("output_tok_s", "out tok/s", ".0f"), ("output_tokens", "out tokens", ".0f"),
                       ("mask_fill_ms_per_step", "mask fill ms/step", ".2f")]


def rows(result: dict) -> dict[str, dict]:
    """One flat row per run: its metrics, its engine's conditions and a few derived values."""
    out = {}
    for label, run in result["runs"].items():
        row = {**run.get("engine", {}), **run}
        if run.get("decode_steps"):
            row["mean_batch"] = run["decode_tokens"] / run["decode_steps"]
        if run.get("gpu_used_gib"):
            row["used"] = " ".join(f"{x:.1f}" for x in run["gpu_used_gib"])
        if run.get("long_ttft_s"):
            row["long_ttft"] = " ".join(f"{x:.2f}" for x in run["long_ttft_s"])
        if run.get("replica_busy_s"):
            row["tokens"] = " ".join(str(x) for x in run["replica_tokens"])
            row["busy"] = " ".join(f"{x:.1f}" for x in run["replica_busy_s"])
        out[label] = row
    return out


def report_throughput(result: dict) -> None:
    """The lines bench.py has always printed."""
    for i, r in enumerate(result["runs"]):
        print(f"run {i}: {r['output_tokens']} tok in {r['total_s']:.2f}s = "
              f"{r['output_tok_s']:.0f} tok/s | TTFT p50 {r['ttft_p50_s']:.2f}s "
              f"p99 {r['ttft_p99_s']:.2f}s | TPOT p50 {r['tpot_p50_ms']:.1f}ms "
              f"p99 {r['tpot_p99_ms']:.1f}ms")
    env = result["environment"]
    print(f"median output throughput: {result['median_output_tok_s']:.0f} tok/s "
          f"({env['device']}, {env['attention_backend']}, "
          f"{'graphs' if env['cuda_graphs'] else 'eager'}, {env['kv_blocks']} KV blocks "
          f"({env.get('kv_cache_dtype', '?').removeprefix('torch.')}), "
          f"peak {result['peak_gpu_gib']:.1f} GiB, import {result['import_s']:.1f}s, "
          f"LLM() {result['startup_s']:.1f}s: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in result["startup_parts_s"].items()) + ")")


def report(name: str, result: dict) -> None:
    """Print one scenario's table, with its headline ratio."""
    if "skipped" in result:
        print(f"\n== {name}: skipped: {result['skipped']}")
        return
    if name == "throughput":
        report_throughput(result)
        return
    w = result["workload"]
    if name == "graphs":
        print_table(f"graphs: eager vs CUDA graphs, {w['num_seqs']} seqs x {w['output_len'][0]} "
                    "output tokens (host ms = step wall time - GPU wait)", rows(result), GRAPHS)
        _headline("decode speedup", result["decode_speedup"], result.get("note"))
    elif name == "prefix-cache":
        print_table(f"prefix-cache: {w['num_seqs']} requests, {w['prefix_blocks']}-block prefix "
                    "distinct vs shared", rows(result), PREFIX)
        _headline("prefill speedup", result["prefill_speedup"])
    elif name == "kv-pressure":
        print_table(f"kv-pressure: {w['num_seqs']} x ({w['input_len']} + {w['output_len']}) "
                    f"tokens, pool {w['pool_blocks']} of {w['peak_need_blocks']} blocks needed",
                    rows(result), KV)
        _headline("completion-time slowdown", result["slowdown"])
    elif name == "long-context":
        print_table(f"long-context: {w['num_seqs']} standard requests, then {w['num_long']} x "
                    f"{w['long_input_len']}-token prompts: one prefill step each vs chunks of "
                    f"{w['budget']}", rows(result), LONG)
        _headline("max decode gap, one-step / chunked", result["max_gap_ratio"])
    elif name == "tp":
        print_table(f"tp: tensor_parallel_size {result['sizes']}, standard workload",
                    rows(result), TP)
    elif name == "dp":
        print_table(f"dp: data_parallel_size 1 vs {result['data_parallel_size']}, standard "
                    f"workload x {result['data_parallel_size']} = {w['num_seqs']} requests "
                    "(balance = least / most busy replica)", rows(result), DP)
    elif name == "rl":
        print_table(f"rl: standard workload ({w['num_seqs']} requests) plain, with logprobs=5 "
                    "and with n=4 on every request", rows(result), RL)
        _report_sleep(result["sleep"])
    elif name == "structured":
        print_table(f"structured: standard workload ({w['num_seqs']} requests, ignore_eos off) "
                    "unconstrained vs a JSON schema on every request (medians of alternated "
                    "rounds)", rows(result), STRUCTURED)
        _headline("JSON-schema throughput / unconstrained, per output token", result["ratio"])


def _report_sleep(s: dict) -> None:
    levels = [k for k in ("awake", "sleep1", "sleep2") if k in s]
    print("memory: " + "  ".join(f"{k}: {s[k]['allocated_gib']:.2f} GiB allocated, "
                                 f"{s[k]['device_used_gib']:.2f} GiB used on the GPU"
                                 for k in levels))
    print(f"sleep(1) {s['sleep1_s']:.2f}s, wake_up {s['wake1_s']:.2f}s, identical outputs "
          f"{s['identical_after_sleep1']}")
    if "sleep2" not in s:
        print("sleep(2) and update_weights skipped: dummy weights, no checkpoint to reload")
        return
    gpu = s.get("update_weights_gpu_s")
    print(f"sleep(2) {s['sleep2_s']:.2f}s, wake_up {s['wake2_s']:.2f}s, update_weights of "
          f"{s['weights_gib']:.2f} GiB from host {s['update_weights_host_s']:.2f}s, from GPU "
          + (f"{gpu:.2f}s" if gpu is not None else "-")
          + f", identical outputs {s['identical_after_sleep2']}")


def _headline(what: str, value: float | None, note: str | None = None) -> None:
    text = f"{value:.2f}x" if value is not None else "-"
    print(f"{what}: {text}" + (f" ({note})" if note else ""))
