"""python -m benchmarks.serve --tiny: the serving benchmark runs end to end on CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serving_benchmark_smoke(tmp_path):
    out = tmp_path / "serve.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--tiny", "--rates",
                           "16,inf", "--engine", "process,thread", "--json", str(out)],
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "offline ceiling:" in proc.stdout and "goodput" in proc.stdout
    result = json.loads(out.read_text())
    assert result["offline"]["output_tok_s"] > 0
    for engine, rate in [(e, r) for e in ("process", "thread") for r in ("16", "inf")]:
        row = result["engines"][engine][rate]
        assert row["completed"] == result["num_requests"] and row["failed"] == 0
        assert row["output_tok_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 <= row["goodput_req_s"] <= row["request_s"]
