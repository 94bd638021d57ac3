"""bench.py --tiny --scenario all: every scenario runs on CPU and reports sane numbers."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """bench.py --tiny with `args`: its JSON and its stdout."""
    out = tmp_path / "bench.json"
    # One thread: the smoke model's ops are tiny, and threads only contend on a shared CI box.
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "bench.py", "--tiny", "--json", str(out), *args],
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def check_environment(result: dict) -> None:
    env = result["environment"]
    for key in ("device", "gpu_count", "torch", "triton", "flash_attn", "command", "seed"):
        assert key in env, key
    assert "--scenario all" in env["command"]
    for run in result.get("runs", {}).values():
        keys = {"attention_backend", "dtype", "cuda_graphs", "block_size", "kv_blocks"}
        assert keys <= set(run["engine"])


def test_every_scenario_on_cpu(tmp_path):
    plot = importlib.util.find_spec("matplotlib") is not None  # the optional `plot` extra
    png = tmp_path / "timeline.png"
    data, stdout = run_bench(tmp_path, "--scenario", "all", *(["--plot", str(png)] if plot else []))
    for title in ("graphs:", "prefix-cache:", "kv-pressure:", "tp: skipped", "dp: skipped",
                  "long-context:", "median output", "rl:", "structured:"):
        assert title in stdout, stdout
    scenarios = data["scenarios"]
    assert list(scenarios) == ["throughput", "graphs", "prefix-cache", "kv-pressure", "tp",
                              "dp", "long-context", "rl", "structured"]
    structured = scenarios["structured"]["runs"]
    assert structured["json schema"]["mask_fill_ms_per_step"] > 0
    assert structured["unconstrained"]["output_tok_s"] > 0
    for name in ("graphs", "prefix-cache", "kv-pressure"):
        check_environment(scenarios[name])

    through = scenarios["throughput"]
    assert through["median_output_tok_s"] > 0 and through["environment"]["device"] == "cpu"
    run = through["runs"][0]
    assert run["prefill_tokens"] == run["prompt_tokens"]
    assert run["decode_tokens"] + through["workload"]["num_seqs"] == run["output_tokens"]

    graphs = scenarios["graphs"]["runs"]
    assert graphs["eager"]["engine"]["enforce_eager"]
    assert not graphs["graphs"]["engine"]["cuda_graphs"]  # CPU: both runs are eager
    for run in graphs.values():
        assert run["decode_tok_s"] > 0 and run["tpot_p50_ms"] > 0
        assert run["gpu_wait_ms"] == 0 and run["host_ms"] == run["step_ms"] > 0  # no GPU

    prefix = scenarios["prefix-cache"]
    w, runs = prefix["workload"], prefix["runs"]
    assert runs["distinct"]["cache_hit_blocks"] == 0
    # The first request computes the shared prefix (the others wait one step for it); every
    # other one hits all of its blocks.
    assert runs["shared"]["cache_hit_blocks"] == (w["num_seqs"] - 1) * w["prefix_blocks"]
    assert 0 < runs["shared"]["hit_rate"] <= 1
    assert runs["shared"]["prefill_tokens"] < runs["distinct"]["prefill_tokens"]
    assert runs["shared"]["peak_kv_blocks_in_use"] < runs["distinct"]["peak_kv_blocks_in_use"]

    kv = scenarios["kv-pressure"]
    small, free = kv["runs"]["small-pool"], kv["runs"]["unconstrained"]
    assert small["engine"]["kv_blocks"] == kv["workload"]["pool_blocks"]
    assert small["preemptions"] > 0 and small["recomputed_tokens"] > 0
    assert small["peak_kv_blocks_in_use"] <= kv["workload"]["pool_blocks"]
    assert free["preemptions"] == 0 and free["recomputed_tokens"] == 0
    assert small["output_tokens"] == free["output_tokens"]

    long = scenarios["long-context"]
    w, runs = long["workload"], long["runs"]
    for run in runs.values():
        assert run["prefill_tokens"] == run["prompt_tokens"] and len(run["long_ttft_s"]) == 2
    assert runs["chunked"]["max_num_batched_tokens"] == w["budget"] < w["long_input_len"]
    assert runs["chunked"]["prefill_steps"] > runs["one-step"]["prefill_steps"]
    assert runs["chunked"]["output_tokens"] == runs["one-step"]["output_tokens"]

    assert "CUDA" in scenarios["tp"]["skipped"]
    assert "--dp N" in scenarios["dp"]["skipped"]  # no GPUs and no --dp: DP needs 2 replicas
    rl = scenarios["rl"]
    plain, n4 = rl["runs"]["plain"], rl["runs"]["n=4"]
    assert n4["completions"] == 4 * plain["completions"]
    assert n4["output_tokens"] == 4 * plain["output_tokens"]  # ignore_eos: lengths are fixed
    assert n4["cache_hit_blocks"] > 0  # the prompt's full blocks are shared
    assert rl["sleep"]["identical_after_sleep1"] and rl["sleep"]["identical_after_sleep2"]
    assert not plot or png.stat().st_size > 0


def test_no_pipeline_runs_the_lockstep_engine(tmp_path):
    data, _ = run_bench(tmp_path, "--no-pipeline")
    assert data["environment"]["pipelined"] is False
    run = data["runs"][0]
    assert run["decode_tokens"] + data["workload"]["num_seqs"] == run["output_tokens"] > 0


@pytest.mark.parametrize("args,message", [
    (["--shape", "qwen3-0.6b", "--model", "/m"], "--shape builds its own checkpoint: --model"),
    (["--shape", "qwen3-0.6b", "--tiny"], "--shape builds its own checkpoint: --tiny"),
    (["--tiny", "--random-weights"], "--tiny builds its own checkpoint: --random-weights"),
    (["--shape", "qwen3-0.6b", "--load-format", "auto"], "needs --load-format dummy"),
    (["--shape", "qwen3-0.6b", "--weight-format", "fp8-block", "--quantization", "fp8"],
     "fp8-block already is FP8"),
    (["--no-calculate-kv-scales"], "--calculate-kv-scales needs --kv-cache-dtype fp8"),
    (["--num-seqs", "0"], "--num-seqs 0 must be at least 1"),
    (["--repeats", "0"], "--repeats 0 must be at least 1"),
    (["--min-input-len", "2000"], "--min-input-len 2000 exceeds --max-input-len 1024"),
    (["--dp", "1"], "--data-parallel-size 1"),
    (["--dp", "2"], "--data-parallel-size is used by --scenario dp only"),
    (["--scenario", "graphs", "--enforce-eager"], "--enforce-eager would be ignored by "
                                                  "--scenario graphs"),
    (["--scenario", "tp", "--tp", "2"], "--tensor-parallel-size would be ignored"),
    (["--scenario", "long-context", "--max-model-len", "8192"], "--max-model-len would be"),
    (["--scenario", "rl", "--repeats", "3"], "--repeats would be ignored by --scenario rl"),
    (["--scenario", "kv-pressure", "--num-seqs", "4"], "--num-seqs would be ignored"),
    (["--scenario", "all", "--max-output-len", "200"], "--scenario graphs (one of all)"),
    (["--json", "/no/such/dir/out.json"], "--json /no/such/dir/out.json: no directory"),
])
def test_bad_flags_are_refused_before_anything_runs(args, message):
    proc = subprocess.run([sys.executable, "bench.py", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_rl_runs_the_standard_workload_of_the_flags(tmp_path):
    data, _ = run_bench(tmp_path, "--scenario", "rl", "--num-seqs", "3", "--max-output-len", "20")
    rl = data["scenarios"]["rl"]
    assert rl["workload"]["num_seqs"] == 3 and rl["workload"]["output_len"] == [16, 20]
    assert rl["runs"]["plain"]["completions"] == 3
