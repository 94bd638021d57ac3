"""Source trees alternated in one call: bench.py from each, round by round.

python -m benchmarks.ab NAME=DIR[@VAR=VALUE...] NAME=DIR[...] [--rounds 3] [--out DIR] -- ARGS

Each round runs `python bench.py BENCH_ARGS --json FILE` once per tree, in the order given, each
in its own process with the tree as the working directory and first on PYTHONPATH, so that a
branch checked out with `git worktree add DIR BRANCH` runs its own code. Alternating puts the
machine's drift on every tree alike. The table gives each tree's median output tok/s and TPOT p50
over the rounds, and their ratio to the first tree's; the JSON of every run lands in --out.
`@VAR=VALUE` sets an environment variable for that tree's processes, so one checkout can be
alternated against itself with a switch flipped (`nopf=.@NANOVLLM_L2_PREFETCH_MB=0`).

    git worktree add ../fp8stages fp8stages
    python -m benchmarks.ab main=. fp8stages=../fp8stages -- --shape llama-3.1-8b \\
        --weight-format fp8-channel --num-seqs 1 --min-input-len 128 --max-input-len 128 \\
        --min-output-len 512 --max-output-len 512
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", metavar="NAME=DIR[@VAR=VALUE...]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="ab-"))
    args = p.parse_args(argv[:split])
    trees = []
    for spec in args.trees:
        name, sep, rest = spec.partition("=")
        path, *assignments = rest.split("@")
        if not (sep and name and os.path.isfile(os.path.join(path, "bench.py"))):
            p.error(f"{spec!r}: each tree is NAME=DIR, with DIR holding bench.py")
        if not all(a.partition("=")[0] and "=" in a for a in assignments):
            p.error(f"{spec!r}: each setting after @ is VAR=VALUE")
        env = dict(a.split("=", 1) for a in assignments)
        trees.append((name, (os.path.abspath(path), env)))
    args.trees = dict(trees)
    if len(args.trees) != len(trees):
        p.error("tree names must differ")
    return args, argv[split + 1:]


def run_once(tree: str, bench_args: list[str], json_path: str,
             settings: dict[str, str] | None = None) -> dict:
    """One bench.py process in `tree`, with `settings` in its environment: its JSON (output
    tok/s and TPOT p50 of its runs)."""
    env = dict(os.environ, **(settings or {}), PYTHONPATH=os.pathsep.join(
        [tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    subprocess.run([sys.executable, "bench.py", *bench_args, "--json", json_path], cwd=tree,
                   env=env, check=True)
    with open(json_path) as f:
        return json.load(f)


def summary(results: dict[str, list[dict]]) -> list[dict]:
    """Per tree: median tok/s and TPOT p50 over its processes, and ratios to the first tree."""
    rows = []
    for name, runs in results.items():
        tok_s = [r["median_output_tok_s"] for r in runs]
        tpot = [statistics.median(x["tpot_p50_ms"] for x in r["runs"]) for r in runs]
        rows.append(dict(tree=name, tok_s=tok_s, tpot_ms=tpot,
                         median_tok_s=statistics.median(tok_s),
                         median_tpot_ms=statistics.median(tpot)))
    for row in rows:
        row["tok_s_ratio"] = row["median_tok_s"] / rows[0]["median_tok_s"]
        row["tpot_ratio"] = row["median_tpot_ms"] / rows[0]["median_tpot_ms"]
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args, bench_args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in args.trees}
    for r in range(args.rounds):
        for name in list(results):  # the trees still in the table
            tree, settings = args.trees[name]
            path = os.path.join(args.out, f"ab_{name}_r{r}.json")
            try:
                results[name].append(run_once(tree, bench_args, path, settings))
            except subprocess.CalledProcessError as e:
                # One broken tree must not cost the others their rounds: it leaves the table.
                print(f"ab: {name} failed in round {r} (exit {e.returncode}); dropped",
                      file=sys.stderr)
                del results[name]
    if not results:
        raise SystemExit("ab: every tree failed")
    rows = summary(results)
    print(f"\n{args.rounds} alternated rounds of bench.py {' '.join(bench_args)}")
    print("| tree | output tok/s (runs) | median | vs first | TPOT p50 ms | vs first |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        runs = " ".join(f"{x:,.0f}" for x in row["tok_s"])
        print(f"| {row['tree']} | {runs} | {row['median_tok_s']:,.0f} | "
              f"{row['tok_s_ratio']:.3f}x | {row['median_tpot_ms']:.3f} | "
              f"{row['tpot_ratio']:.3f}x |")
    return rows


if __name__ == "__main__":
    main()
