#!/usr/bin/env bash
# Model families on one H200, in two device calls of < 10 min each:
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_families.sh tests   the GPU parity tests of every
#       family (float32: Triton eager and graphs, the torch backend on CUDA)
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_families.sh bench   the standard workload on the
#       Llama-3.1-8B and Qwen2.5-7B shapes (dummy bf16 weights, CUDA graphs) with flash-attn and
#       Triton, 3 timed runs per engine, each beside its floor from benchmarks/floor.py
# Run from the project root with carry [".device"]; logs and JSON land in $OUT.
source .device/env.sh
set -uo pipefail
out=${OUT:-/tmp/out}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ ${1:-bench} == tests ]]; then
  timeout 500 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_families.py \
    > "$out/gpu_families.log" 2>&1
  grep -E "passed|failed|^FAILED" "$out/gpu_families.log"
  exit
fi
for shape in llama-3.1-8b qwen2.5-7b; do
  for backend in flash-attn triton; do
    timeout 130 python bench.py --shape "$shape" --attention-backend "$backend" --repeats 3 \
      --json "$out/${shape}_${backend}.json" > "$out/${shape}_${backend}.log" 2>&1
    grep -E "^median" "$out/${shape}_${backend}.log" | sed "s/^/[$shape $backend] /"
  done
done
python - "$out" <<'PY'
import json, os, sys
from benchmarks.floor import floor
from benchmarks.shapes import SHAPES
print("| shape | attention | runs tok/s | median tok/s | floor tok/s | of floor | LLM() s |")
print("|---|---|---|---|---|---|---|")
for shape in ("llama-3.1-8b", "qwen2.5-7b"):
    bound = floor(SHAPES[shape], 4.27e12, 793e12)["tok_s"]
    for backend in ("flash-attn", "triton"):
        path = os.path.join(sys.argv[1], f"{shape}_{backend}.json")
        if not os.path.exists(path):
            print(f"| {shape} | {backend} | failed: see {shape}_{backend}.log | | {bound:,.0f} | | |")
            continue
        d = json.load(open(path))
        runs = " ".join(f"{r['output_tok_s']:,.0f}" for r in d["runs"])
        median = d["median_output_tok_s"]
        print(f"| {shape} | {d['environment']['attention_backend']} | {runs} | {median:,.0f} | "
              f"{bound:,.0f} | {median / bound:.0%} | {d['startup_s']:.1f} |")
PY
