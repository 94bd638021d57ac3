"""benchmarks.step_floor: per-step floors and their bucket table add up (CPU, tiny model)."""
import json

import pytest

from benchmarks.floor import step_seconds
from benchmarks.shapes import SHAPES
from benchmarks.step_floor import COLUMNS, bucket_rows, main, with_floors


def test_buckets_split_at_the_issue_bounds():
    steps = [dict(prefill=p, batch=b, tokens=b, gpu_s=1.0, floor_s=0.5, slack_s=0.5, gap_s=0.1)
             for p, b in ((True, 3), (False, 16), (False, 17), (False, 64), (False, 65),
                          (False, 256), (False, 257))]
    rows = bucket_rows(steps)
    assert [(r["kind"], r["batch"], r["steps"]) for r in rows] == [
        ("prefill", "1-16", 1), ("decode", "1-16", 1), ("decode", "17-64", 2),
        ("decode", "65-128", 1), ("decode", "129-256", 1), ("decode", "257+", 1),
        ("total", "all", 7)]
    assert rows[-1]["tokens"] == 3 + 16 + 17 + 64 + 65 + 256 + 257


def test_floor_is_the_larger_bound():
    """A 16k-token prefill is FLOP-bound, a decode step of 8 bandwidth-bound (H200 rates)."""
    shape, bw, fl = SHAPES["qwen3-0.6b"], 4.27e12, 793e12
    prefill = step_seconds(shape, 16384, 16384, 0.0, bw, fl)
    assert prefill == pytest.approx(2 * 596049920 * 16384 / fl, rel=1e-3)
    decode = with_floors([dict(prefill=False, batch=8, tokens=8, kv_tokens=8000, gpu_s=1e-3,
                               chunks=[(1, 999)] * 8)], shape, bw, fl)[0]
    assert decode["floor_s"] == step_seconds(shape, 8, 8000, 0.0, bw, fl) > 8 * 2 * 596e6 / fl
    assert decode["slack_s"] == pytest.approx(1e-3 - decode["floor_s"])


def test_tiny_run_table_adds_up(tiny_model, tmp_path, capsys):
    result = main(["--model", tiny_model, "--tiny", "--out", str(tmp_path)])
    steps, rows, run = result["steps"], result["rows"], result["run"]
    total = rows[-1]
    assert total["kind"] == "total" and total["steps"] == len(steps)
    for column in COLUMNS:
        assert sum(r[column] for r in rows[:-1]) == pytest.approx(total[column])
    assert all(s["floor_s"] > 0 and s["gpu_s"] > 0 and s["gap_s"] >= 0 for s in steps)
    assert total["slack_s"] == pytest.approx(total["gpu_s"] - total["floor_s"])
    # Every prompt token is prefilled once; each request's first token comes from its prefill.
    prefill = [s for s in steps if s["prefill"]]
    assert sum(s["tokens"] for s in prefill) == run["prompt_tokens"]
    num_seqs = sum(s["batch"] for s in prefill)
    assert sum(s["tokens"] for s in steps if not s["prefill"]) == run["output_tokens"] - num_seqs
    table = capsys.readouterr().out.strip().splitlines()[-len(rows) - 2:]
    assert table[0].startswith("| kind | batch |") and table[-1].startswith("| total | all |")
    with open(tmp_path / f"step_floor_{result['backend']}.json") as f:
        assert json.load(f)["rows"] == rows
