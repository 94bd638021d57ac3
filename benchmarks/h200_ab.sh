#!/usr/bin/env bash
# Alternate bench.py configurations A B A B ... on the GPU machine (one process per run, so
# each gets a clean GPU); JSON results land in $OUT. Usage: benchmarks/h200_ab.sh ROUNDS "ARGS A" "ARGS B" ...
# An ARGS string starting with @DIR runs DIR's bench.py (e.g. a worktree of a baseline commit).
set -uo pipefail
rounds=$1; shift
out=${OUT:-/tmp/out}
for ((r = 0; r < rounds; r++)); do
  i=0
  for args in "$@"; do
    name=$(echo "$args" | tr -c 'a-zA-Z0-9\n' '_' | sed 's/__*/_/g')
    dir=.
    if [[ $args == @* ]]; then dir=${args%% *}; dir=${dir#@}; args=${args#"@$dir"}; fi
    # shellcheck disable=SC2086
    (cd "$dir" && { [[ ! -f .commit ]] || export NANOVLLM_COMMIT=$(cat .commit); } && PYTHONPATH=".:${PYTHONPATH:-}" python bench.py --random-weights $args --json "$out/r${r}_c${i}.json") 2>&1 \
      | grep -E "^(run|median)" | sed "s/^/[$r:$i $name] /"
    i=$((i + 1))
  done
done
python - "$out" <<'PY'
import glob, json, statistics, sys
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/r*_c*.json")):
    d = json.load(open(f))
    key = f.rsplit("_c", 1)[1].split(".")[0]
    rows.setdefault(key, []).append(d)
print("| config | runs tok/s | median tok/s | import s | LLM() s (parts) |")
for key, ds in rows.items():
    e = ds[0]["environment"]
    tps = [d["median_output_tok_s"] for d in ds]
    parts = ", ".join(f"{k} {v:.1f}" for k, v in ds[0]["startup_parts_s"].items())
    lockstep = "" if e.get("pipelined", True) else " lockstep"
    print(f"| {key}: {e.get('commit', '')} {e['attention_backend']}{lockstep} "
          f"{'graphs' if e['cuda_graphs'] else 'eager'} | "
          f"{' '.join(f'{t:.0f}' for t in tps)} | {statistics.median(tps):.0f} | "
          f"{ds[0]['import_s']:.1f} | {ds[0]['startup_s']:.1f} ({parts}) |")
PY
