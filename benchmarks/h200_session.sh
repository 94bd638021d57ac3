#!/usr/bin/env bash
# One device call: the standard bench per backend, GPU parity tests, eager; logs under $OUT.
source .device/env.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for backend in flash-attn triton; do
  timeout 100 python bench.py --random-weights --repeats 3 --attention-backend $backend \
    --json $OUT/bench_$backend.json 2>&1 | grep -E "^(run|median)"
done
timeout 100 python -m pytest -q -m gpu tests/gpu -s -p no:cacheprovider \
  -k "graphs or logits or shutdown" 2>&1 | grep -vE "DEBUG|Writing|Loading" > $OUT/gpu_tests.log
grep -E "passed|failed|argmax|relative error|^FAILED" $OUT/gpu_tests.log
timeout 90 python bench.py --random-weights --enforce-eager --json $OUT/bench_eager.json 2>&1 | grep -E "^(run|median)"
