"""example.py, the README's first run command: without a checkpoint it says so and chats with a
tiny random model instead (CPU)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_example_runs_without_a_checkpoint(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "example.py", "--model", str(tmp_path / "none")],
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Running a tiny RANDOM demo model instead" in proc.stdout
    assert proc.stdout.count("Completion: ") == 2
    assert (tmp_path / "nanovllm-demo-random" / "model.safetensors").is_file()
