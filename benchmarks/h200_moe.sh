#!/usr/bin/env bash
# Qwen3-MoE on one H200, in device calls of < 10 min each:
#   bash benchmarks/h200_moe.sh tests   float32 parity with transformers (Triton MoE kernel, eager
#       and CUDA graphs; the torch loop), the kernel in a CUDA graph, and its bf16 error at the
#       Qwen3-30B-A3B expert shape (printed)
#   bash benchmarks/h200_moe.sh bench   the standard workload on the Qwen3-30B-A3B shape (dummy
#       bf16 weights, CUDA graphs), 2 timed runs, beside its floor from benchmarks/floor.py
#   bash benchmarks/h200_moe.sh steps   decode step time beside its floor at batch 1, 16, 64, 256
# Run from the project root with carry [".device"]; logs and JSON land in $OUT.
source .device/env.sh
set -uo pipefail
out=${OUT:-/tmp/out}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case ${1:-bench} in
  tests)
    timeout 540 python -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_gpu_moe.py \
      tests/kernels/test_fused_moe.py > "$out/gpu_moe.log" 2>&1
    grep -E "bf16 fused MoE|passed|failed|^FAILED" "$out/gpu_moe.log" ;;
  bench)
    timeout 540 python bench.py --shape qwen3-30b-a3b --repeats 2 --json "$out/qwen3-30b-a3b.json" \
      > "$out/qwen3-30b-a3b.log" 2>&1
    grep -E "^median|tok/s|TPOT" "$out/qwen3-30b-a3b.log" | tail -6
    python -m benchmarks.floor qwen3-30b-a3b ;;
  steps)
    timeout 540 python -m benchmarks.moe_steps --shape qwen3-30b-a3b --batches 1 16 64 256 \
      > "$out/qwen3-30b-a3b_steps.log" 2>&1
    tail -7 "$out/qwen3-30b-a3b_steps.log" ;;
esac
