#!/usr/bin/env bash
# FP8 KV cache on one H200, in one device call of < 8 min:
#   1. the FP8 tests on CUDA: the kernel tests (byte-exact FP8 writes, Triton readers vs the
#      torch reference) and the engine's Triton FP8 path, eager and CUDA graphs
#   2. benchmarks/fp8_accuracy on the Qwen3-0.6B shape (bf16), triton, both scale policies
#   3. the standard bench alternating bf16 KV and FP8 KV (both triton), 3 runs each
# Run from the project root with carry [".device"]; logs and JSON land in $OUT; a short table
# (tests, accuracy, median tok/s and KV blocks) is printed last.
source .device/env.sh
set -uo pipefail
out=${OUT:-/tmp/out}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python -m pytest -q -s -p no:cacheprovider tests/kernels/test_kv_fp8.py \
  tests/gpu/test_kv_fp8_cuda.py > "$out/fp8_tests.log" 2>&1
timeout 150 python -m benchmarks.fp8_accuracy --checkpoints qwen3-0.6b --backends triton \
  --json "$out/fp8_accuracy.json" > "$out/fp8_accuracy.log" 2>&1
mkdir -p "$out/bench"
OUT="$out/bench" timeout 270 bash benchmarks/h200_ab.sh 3 "--attention-backend triton" \
  "--attention-backend triton --kv-cache-dtype fp8" > "$out/fp8_bench.log" 2>&1
echo "== tests"; grep -E "passed|failed|^FAILED|^ERROR" "$out/fp8_tests.log" | tail -5
echo "== accuracy (teacher-forced, FP8 vs bf16 KV)"; tail -4 "$out/fp8_accuracy.log"
echo "== standard bench, alternated"
python - "$out/bench" <<'PY'
import glob, json, statistics, sys
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/r*_c*.json")):
    rows.setdefault(f.rsplit("_c", 1)[1].split(".")[0], []).append(json.load(open(f)))
for key, ds in rows.items():
    e = ds[0]["environment"]
    tps = [d["median_output_tok_s"] for d in ds]
    print(f"{e.get('kv_cache_dtype', '?'):<22} {e['attention_backend']:<7} "
          f"{'graphs' if e['cuda_graphs'] else 'eager'}  runs {' '.join(f'{t:.0f}' for t in tps)}"
          f"  median {statistics.median(tps):.0f} tok/s  KV blocks {e['kv_blocks']}")
PY
