"""benchmarks.ab: trees alternate round by round, each running its own code (CPU, tiny model)."""
import json
import os
import shutil

import pytest

from benchmarks.ab import main, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--tiny", "--num-seqs", "2", "--min-input-len", "8", "--max-input-len", "8",
        "--min-output-len", "4", "--max-output-len", "4"]


@pytest.mark.slow
def test_trees_alternate_and_run_their_own_code(tmp_path, capsys):
    """A copy of the tree whose benchmarks name their commit "other" shows that each process ran
    its own tree's code; both trees run once a round, the first tree first."""
    other = tmp_path / "other"
    shutil.copytree(ROOT, other, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", ".device", "out"))
    runs = (other / "benchmarks" / "runs.py").read_text()
    marked = runs.replace('def commit() -> str | None:\n', 'def commit() -> str | None:\n'
                          '    return "other"\n', 1)
    assert marked != runs
    (other / "benchmarks" / "runs.py").write_text(marked)
    out = tmp_path / "out"
    rows = main(["base=" + ROOT, f"other={other}", "--rounds", "2", "--out", str(out), "--",
                 *TINY])
    assert [r["tree"] for r in rows] == ["base", "other"]
    assert all(len(r["tok_s"]) == 2 and r["median_tok_s"] > 0 for r in rows)
    assert rows[0]["tok_s_ratio"] == 1.0
    names = sorted(os.listdir(out))
    assert names == ["ab_base_r0.json", "ab_base_r1.json", "ab_other_r0.json", "ab_other_r1.json"]
    mtime = {n: os.path.getmtime(out / n) for n in names}
    assert mtime["ab_base_r0.json"] < mtime["ab_other_r0.json"] < mtime["ab_base_r1.json"]
    assert "| other |" in capsys.readouterr().out
    for name in names:
        with open(out / name) as f:
            run = json.load(f)
        assert run["runs"]
        assert (run["environment"]["commit"] == "other") == name.startswith("ab_other")


def test_bad_trees_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        parse_args([f"a={tmp_path}", "--", "--tiny"])  # no bench.py there
    with pytest.raises(SystemExit):
        parse_args([f"a={ROOT}", f"a={ROOT}"])
    with pytest.raises(SystemExit):
        parse_args([ROOT])


# a stand-in bench.py: its JSON gives FAKE_TOK_S (default 100) output tok/s
FAKE_BENCH = ("import json, os, sys\n"
              "path = sys.argv[sys.argv.index('--json') + 1]\n"
              "tok_s = float(os.environ.get('FAKE_TOK_S', '100'))\n"
              "run = {'median_output_tok_s': tok_s, 'runs': [{'tpot_p50_ms': 2.0}]}\n"
              "json.dump(run, open(path, 'w'))\n")


def _tree(path, bench: str = FAKE_BENCH):
    """A directory holding only a bench.py."""
    path.mkdir()
    (path / "bench.py").write_text(bench)
    return path


def test_a_failing_tree_is_dropped_and_the_others_finish(tmp_path, capsys):
    """A tree whose bench.py fails leaves the table; the other trees still run every round."""
    good = _tree(tmp_path / "good")
    bad = _tree(tmp_path / "bad", "raise SystemExit(3)\n")
    rows = main([f"good={good}", f"bad={bad}", "--rounds", "2", "--out", str(tmp_path / "o"),
                 "--", "--tiny"])
    assert [r["tree"] for r in rows] == ["good"]
    assert rows[0]["tok_s"] == [100.0, 100.0]
    assert "bad failed in round 0 (exit 3)" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="every tree failed"):
        main([f"bad={bad}", "--rounds", "1", "--out", str(tmp_path / "p"), "--", "--tiny"])


def test_a_tree_can_run_with_a_setting_flipped(tmp_path):
    """NAME=DIR@VAR=VALUE: the same checkout alternated against itself, VAR set for one name."""
    tree = _tree(tmp_path / "t")
    rows = main([f"base={tree}", f"flipped={tree}@FAKE_TOK_S=150@OTHER=a=b", "--rounds", "1",
                 "--out", str(tmp_path / "o"), "--", "--tiny"])
    assert [(r["tree"], r["median_tok_s"]) for r in rows] == [("base", 100.0), ("flipped", 150.0)]
    assert rows[1]["tok_s_ratio"] == 1.5
    for bad in (f"x={tree}@NOVALUE", f"x={tree}@=1"):
        with pytest.raises(SystemExit):
            parse_args([bad])
