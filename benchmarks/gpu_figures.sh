#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, from the project root on a GPU machine:
#
#   benchmarks/gpu_figures.sh [--tiny] [--rounds N] [--upstream CMD] [--shapes A,B] [--out DIR]
#                             [bench] [shapes] [tests] [-- BENCH_FLAGS...]
#
#   bench   the standard workload (bench.py --random-weights), one process per run, alternated
#           run by run for N rounds (default 3): the default backend, --attention-backend triton,
#           --kv-cache-dtype fp8, then CMD if given: upstream nano-vLLM's own bench, a shell
#           command that prints its "Throughput: X tok/s" line (e.g. 'cd ../nano-vllm && python
#           bench.py'; it loads ~/huggingface/Qwen3-0.6B). A table of tok/s per config comes last.
#   shapes  the standard workload on each shape of benchmarks/shapes.py (or --shapes), dummy bf16
#           weights, 3 runs in one process, beside its floor at H200 rates (benchmarks/floor.py)
#   decode  (named only) a batch-1 decode step phase by phase, beside its floor
#           (benchmarks.decode_step --profile): Qwen3-0.6B alone and with a rank-16 adapter,
#           Llama-3.1-8B in bf16 and FP8 per channel
#   tests   every GPU-marked test (~3.5 min on an H200), then bf16 argmax agreement with
#           transformers per backend (tests/accuracy/bf16_agreement.py); the kernel tests also
#           run on CUDA when present, apart (`python -m pytest tests/kernels`: over 10 minutes)
#   --tiny  a CPU smoke run of this script (CI): bench.py --tiny without the Triton config,
#           shapes prints the floors without runs, decode runs the tiny model, tests only
#           collects tests/gpu
#
# No part named: all three, in that order. BENCH_FLAGS go to every bench.py run. Logs and JSON
# land in DIR (default $OUT, else ./out). A part can exceed a machine's time limit: run the parts
# (and the larger shapes) as separate calls. A fresh machine's first run compiles the Triton
# kernels inside its timed run: compare medians of 3 or more rounds. Where the tree travels
# without .git, set NANOVLLM_COMMIT=<hash> so the JSON names its commit. Exits non-zero if any
# run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
tiny="" rounds=3 upstream="" shape_list="" out=${OUT:-out} parts=() extra=()
while (($#)); do
  case $1 in
    --tiny) tiny=1 ;;
    --rounds) rounds=$2; shift ;;
    --upstream) upstream=$2; shift ;;
    --shapes) shape_list=$2; shift ;;
    --out) out=$2; shift ;;
    bench | shapes | decode | tests) parts+=("$1") ;;
    --) shift; extra=("$@"); break ;;
    *) sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"; exit 2 ;;
  esac
  shift
done
((${#parts[@]})) || parts=(bench shapes tests)
mkdir -p "$out"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ $tiny ]]; then
  export OMP_NUM_THREADS=1  # the tiny model's ops are small: threads only contend
  model=(--tiny) configs=("" "--kv-cache-dtype fp8")  # no Triton attention without CUDA
else
  model=(--random-weights) configs=("" "--attention-backend triton" "--kv-cache-dtype fp8")
fi
failed=0
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
  'cuda', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"

bench() {
  rm -f "$out"/bench_r*_c* "$out"/upstream_r*.log  # the table reads every run's file in $out
  for ((r = 0; r < rounds; r++)); do
    for i in "${!configs[@]}"; do
      log=$out/bench_r${r}_c$i
      # shellcheck disable=SC2086  # a config is several flags
      python bench.py "${model[@]}" ${configs[i]} "${extra[@]}" --json "$log.json" > "$log.log" \
        2>&1 || { failed=1; echo "failed: $log.log"; }
      grep "^median" "$log.log" | sed "s/^/[round $r: ${configs[i]:-default}] /"
    done
    if [[ $upstream ]]; then
      bash -c "$upstream" > "$out/upstream_r$r.log" 2>&1 || { failed=1; echo "upstream failed"; }
      grep -o "Throughput: [0-9.]*" "$out/upstream_r$r.log" | sed "s/^/[round $r: upstream] /"
    fi
  done
  python - "$out" "${configs[@]}" <<'PY' || failed=1
import glob, json, re, statistics, sys
out, configs = sys.argv[1], sys.argv[2:]
rows = {}
for i, config in enumerate(configs):
    runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/bench_r*_c{i}.json"))]
    if runs:
        e = runs[0]["environment"]
        label = (f"{config or 'default'} ({e['attention_backend']}, "
                 f"{'graphs' if e['cuda_graphs'] else 'eager'}, {e['kv_blocks']} KV blocks)")
        rows[label] = [d["median_output_tok_s"] for d in runs]
found = [re.findall(r"Throughput: ([0-9.]+)", open(f).read())
         for f in sorted(glob.glob(f"{out}/upstream_r*.log"))]
upstream = [float(m[-1]) for m in found if m]
if upstream:
    rows["upstream nano-vLLM"] = upstream
base = statistics.median(upstream) if upstream else None
print("| config | runs tok/s | median tok/s |" + (" vs upstream |" if base else ""))
print("|---|---|---|" + ("---|" if base else ""))
for label, tps in rows.items():
    median = statistics.median(tps)
    print(f"| {label} | {' '.join(f'{t:,.0f}' for t in tps)} | {median:,.0f} |"
          + (f" {median / base:.2f}x |" if base else ""))
PY
}

shapes() {
  local names=${shape_list:-$(python -c "from benchmarks.shapes import SHAPES; print(*SHAPES)")}
  for shape in ${names//,/ }; do
    rm -f "$out/shape_$shape.json"
    [[ $tiny ]] && continue  # CPU: a real shape is too large to run; the floors alone
    python bench.py --shape "$shape" --repeats 3 "${extra[@]}" --json "$out/shape_$shape.json" \
      > "$out/shape_$shape.log" 2>&1 || { failed=1; echo "failed: $out/shape_$shape.log"; }
  done
  # shellcheck disable=SC2086  # one argument per shape
  python - "$out" ${names//,/ } <<'PY' || failed=1
import json, os, sys
from benchmarks.floor import floor
from benchmarks.shapes import SHAPES
out, names = sys.argv[1], sys.argv[2:]
print("| shape | attention | runs tok/s | median tok/s | floor tok/s | of floor | LLM() s |")
print("|---|---|---|---|---|---|---|")
for name in names:
    bound = floor(SHAPES[name], 4.27e12, 793e12)["tok_s"]
    path = f"{out}/shape_{name}.json"
    if not os.path.exists(path):
        print(f"| {name} | not run | | | {bound:,.0f} | | |")
        continue
    d = json.load(open(path))
    runs = " ".join(f"{r['output_tok_s']:,.0f}" for r in d["runs"])
    median = d["median_output_tok_s"]
    print(f"| {name} | {d['environment']['attention_backend']} | {runs} | {median:,.0f} | "
          f"{bound:,.0f} | {median / bound:.0%} | {d['startup_s']:.1f} |")
PY
}

decode() {
  local runs=("" "--lora-rank 16" "--shape llama-3.1-8b"
              "--shape llama-3.1-8b --weight-format fp8-channel") profile=(--profile)
  [[ $tiny ]] && runs=("--tiny --tokens 8" "--tiny --tokens 8 --lora-rank 8") profile=()
  for i in "${!runs[@]}"; do
    # shellcheck disable=SC2086  # a run is several flags
    python -m benchmarks.decode_step ${runs[i]} "${profile[@]}" > "$out/decode_$i.log" 2>&1 \
      || { failed=1; echo "failed: $out/decode_$i.log"; }
    sed -n '/a decode step over/,$p' "$out/decode_$i.log"
  done
}

tests() {
  local pytest=(python -m pytest -q -p no:cacheprovider)
  if [[ $tiny ]]; then "${pytest[@]}" --collect-only tests/gpu | tail -1 || failed=1; return; fi
  "${pytest[@]}" -s -m gpu -rfEs --durations=15 tests > "$out/gpu_tests.log" 2>&1 || failed=1
  grep -E "passed|failed|^(FAILED|ERROR|SKIPPED)" "$out/gpu_tests.log"
  python -m tests.accuracy.bf16_agreement --json "$out/bf16_agreement.json" \
    > "$out/bf16_agreement.log" 2>&1 || failed=1
  tail -8 "$out/bf16_agreement.log"
}

for part in "${parts[@]}"; do
  echo "== $part"
  "$part"
done
exit "$failed"
