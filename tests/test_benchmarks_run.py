"""Every script in benchmarks/ runs in CI, at least its smallest CPU case: each file has a case
here or names the test that runs it, and a file added without either fails this test."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# File -> (the test that runs it, what that test runs): bench.py --tiny --scenario all runs the
# library behind bench.py.
BENCH = ("tests/test_bench.py", "bench.py")
ELSEWHERE = {
    "__init__.py": BENCH, "cli.py": BENCH, "runs.py": BENCH, "scenarios.py": BENCH,
    "workloads.py": BENCH, "sizes.py": BENCH, "report.py": BENCH, "rl.py": BENCH,
    "structured.py": BENCH,
    "random_checkpoints.py": ("tests/conftest.py", "benchmarks.random_checkpoints"),
    "step_floor.py": ("tests/test_step_floor.py", "benchmarks.step_floor"),
    "ceilings.py": ("tests/test_ceilings.py", "benchmarks.ceilings"),
    "serve.py": ("tests/serve/test_serve_bench.py", "benchmarks.serve"),
    "serve_client.py": ("tests/serve/test_serve_bench.py", "benchmarks.serve"),
    "fp8.py": ("tests/test_fp8_bench.py", "fp8.run_engine"),
    "decode_step.py": ("tests/test_decode_step.py", "benchmarks.decode_step"),
    "ab.py": ("tests/test_ab.py", "benchmarks.ab"),
    "compile_bursts.py": ("tests/test_compile_bursts.py", "benchmarks.compile_bursts"),
}


def run(*argv: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """argv from the project root, one thread (the smoke model's ops are tiny)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **env,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(argv, cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)


def ok(proc: subprocess.CompletedProcess, *expected: str) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stdout, proc.stdout[-3000:]


def cold_compiles(tmp_path: Path) -> None:
    proc = run(sys.executable, "-m", "benchmarks.cold_compiles", "--tiny", tmp_path=tmp_path,
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    ok(proc, "LLM() on an empty Triton cache:", "first run: ", "compiled inside it: 0",
       "first run / warm run:")
    # the table prints (interpreted kernels compile nothing: its attribution is
    # tests/test_compile_bursts.py's)
    proc = run(sys.executable, "-m", "benchmarks.cold_compiles", "--tiny", "--profile",
               "--num-seqs", "2", tmp_path=tmp_path, TRITON_CACHE_DIR=str(tmp_path / "profiled"))
    ok(proc, "| phase | s | variants |", "compile bursts 0.00 s of LLM()'s",
       "compiles outside the phases: 0")
    proc = run(sys.executable, "-m", "benchmarks.cold_compiles", "--ab", "--profile", "--tiny",
               tmp_path=tmp_path)
    assert proc.returncode == 2 and "run it without --ab" in proc.stderr, proc.stderr
    proc = run(sys.executable, "-m", "benchmarks.cold_compiles", "--ab", "--tiny",
               tmp_path=tmp_path)
    ok(proc, "round 1 workers: LLM() on an empty Triton cache:",
       "round 1 threads: LLM() on an empty Triton cache:", "compile-ahead threads 0")
    for flag in ("--json", "--rep"):  # bench.py flags it would ignore, abbreviated too
        proc = run(sys.executable, "-m", "benchmarks.cold_compiles", "--tiny", flag, "2",
                   tmp_path=tmp_path)
        assert proc.returncode == 2 and "would be ignored here" in proc.stderr, proc.stderr


def shapes(tmp_path: Path) -> None:
    proc = run(sys.executable, "-m", "benchmarks.shapes", "--tiny", "--rounds", "2",
               tmp_path=tmp_path)
    ok(proc, "round 2 tiny fixed: ", "| shape | measured limits tok/s |", "| tiny | ")


def floor(tmp_path: Path) -> None:
    proc = run(sys.executable, "-m", "benchmarks.floor", "--steps", "1", "256",
               tmp_path=tmp_path)
    ok(proc, "| qwen3-0.6b | 1.19 | ", "| 35,673 |", "| qwen3-30b-a3b | 256 |")
    proc = run(sys.executable, "-m", "benchmarks.floor", "llama-3.1-8b", "--weight-format", "fp8",
               tmp_path=tmp_path)
    ok(proc, "| llama-3.1-8b | 8.03 | ", "| 19,106 |")


def gpu_figures(tmp_path: Path) -> None:
    proc = run("bash", "benchmarks/gpu_figures.sh", "--tiny", "--rounds", "1", "--out",
               str(tmp_path), "--upstream", "echo 'Total: 1tok, Time: 1s, Throughput: 100.00tok/s'",
               tmp_path=tmp_path)
    ok(proc, "== bench", "| default (", "| --kv-cache-dtype fp8 (",
       "| upstream nano-vLLM | 100 | 100 | 1.00x |", "| qwen3-0.6b | not run | | | 35,673 |",
       "== tests", " tests collected")
    proc = run("bash", "benchmarks/gpu_figures.sh", "--tiny", "--out", str(tmp_path), "decode",
               tmp_path=tmp_path)
    ok(proc, "== decode", "tiny, batch 1: ", "tiny, batch 1, LoRA rank 8: ")
    assert proc.stdout.count("| - - - pack |") == 2
    run0 = json.loads((tmp_path / "bench_r0_c1.json").read_text())
    assert run0["environment"]["kv_cache_dtype"] == "torch.float8_e4m3fn"
    assert run("bash", "benchmarks/gpu_figures.sh", "--no-such-flag",
               tmp_path=tmp_path).returncode == 2


def plot(tmp_path: Path) -> None:
    """A --json file's timelines drawn later; without matplotlib (the optional `plot` extra)
    the command says what to install."""
    results = tmp_path / "bench.json"
    timeline = [[0.0, 0.1, True, 4, 400], [0.1, 0.01, False, 4, 4], [0.11, 0.01, False, 3, 3]]
    results.write_text(json.dumps(dict(scenario="throughput", runs=[dict(timeline=timeline)])))
    png = tmp_path / "bench.png"
    proc = run(sys.executable, "-m", "benchmarks.plot", str(results), str(png), tmp_path=tmp_path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode != 0 and "pip install -e '.[plot]'" in proc.stderr, proc.stderr
        return
    ok(proc, "plot: 1 runs")
    assert png.stat().st_size > 0


def profile_steps(tmp_path: Path) -> None:
    proc = run(sys.executable, "-m", "benchmarks.profile_steps", "--tiny", "--num-seqs", "4",
               tmp_path=tmp_path)
    ok(proc, "== prefill (4 prompts, 1 token)", "== prefill + 32 decode steps at batch 4",
       "aten::")


def soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = run(sys.executable, "-m", "benchmarks.soak", "--tiny", "--calls", "3", "--json",
               str(out), tmp_path=tmp_path)
    ok(proc, "leaked_blocks")
    summary = json.loads(out.read_text())
    assert summary["calls"] == 3 and summary["leaked_blocks"] == 0 and summary["requests"] > 0


def lora(tmp_path: Path) -> None:
    proc = run(sys.executable, "-m", "benchmarks.lora", "--tiny", "--rounds", "1",
               tmp_path=tmp_path)
    ok(proc, "4 rank-16 adapters round-robin", "batch-1 TPOT: base",
       "greedy agreement with transformers + peft (float32")


# File -> its smallest CPU case, run here.
def gemv_probe(tmp_path: Path) -> None:
    """Both one-token paths of each tiny shape, interpreted: they must agree (the probe
    asserts it) and print a row each."""
    proc = run(sys.executable, "-m", "benchmarks.gemv_probe", "--tiny", tmp_path=tmp_path)
    ok(proc, "| o_proj, fp16 |", "| qkv_proj, FP8 |", "| gate_up + SiLU, FP8 |")


def moe_sweep(tmp_path: Path) -> None:
    """The sweep's grid without a GPU (tests/kernels/test_fused_moe_config.py runs its table)."""
    proc = run(sys.executable, "-m", "benchmarks.moe_sweep", "--dry-run", "--quick",
               tmp_path=tmp_path)
    ok(proc, "fp8         8192 tokens:", "228 timings of 48 kernel configurations")


CASES = {"cold_compiles.py": cold_compiles, "floor.py": floor, "gpu_figures.sh": gpu_figures,
         "gemv_probe.py": gemv_probe, "lora.py": lora, "moe_sweep.py": moe_sweep, "plot.py": plot,
         "profile_steps.py": profile_steps, "shapes.py": shapes, "soak.py": soak}
SLOW = {"gpu_figures.sh", "profile_steps.py"}  # each takes ~20-30 s on CPU


def test_every_script_has_a_case():
    scripts = {p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")}
    assert scripts - set(CASES) - set(ELSEWHERE) == set(), \
        "a script in benchmarks/ without a CPU case: add one to CASES or ELSEWHERE"
    assert set(CASES) | set(ELSEWHERE) <= scripts, "a case for a script that is gone"
    for name, (test, runs) in ELSEWHERE.items():
        assert runs in (ROOT / test).read_text(), (name, test, runs)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else [])
                                  for n in sorted(CASES)])
def test_script_runs_its_smallest_case(name, tmp_path):
    CASES[name](tmp_path)
