"""benchmarks.ceilings: a run with kernels skipped does the same steps as the shipped run (CPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.step_floor import main as step_floor_main

ROOT = Path(__file__).resolve().parents[1]


def run_ceilings(*args: str) -> subprocess.CompletedProcess:
    """benchmarks.ceilings in its own process: its skips patch classes for the whole process."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "benchmarks.ceilings", *args], cwd=ROOT,
                          env=env, text=True, capture_output=True, timeout=300)


def test_skipping_every_class_keeps_the_steps(tiny_model, tmp_path):
    out = tmp_path / "skipped"
    proc = run_ceilings("--skip", "norm,silu,qk,gemm", "--model", tiny_model, "--tiny",
                        "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== skipped: norm, silu, qk, gemm" in proc.stdout
    assert "| total | all |" in proc.stdout
    skipped = json.loads(next(out.glob("step_floor_*.json")).read_text())["steps"]
    shipped = step_floor_main(["--model", tiny_model, "--tiny", "--out", str(tmp_path)])["steps"]
    work = ("prefill", "batch", "tokens", "kv_tokens")
    assert [tuple(s[k] for k in work) for s in skipped] == \
        [tuple(s[k] for k in work) for s in shipped]


def test_unknown_class_is_refused():
    proc = run_ceilings("--skip", "norm,softmax")
    assert proc.returncode != 0 and "'softmax' is not one of" in proc.stderr
