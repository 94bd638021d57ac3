#!/usr/bin/env bash
# The H200 checks and figures the open issues need, in two device calls of < 10 min each:
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_session.sh tests-and-ab
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_session.sh startup-and-scenarios
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_session.sh ab-vs-base   (needs .ab_base/, below)
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_session.sh tp-x2        (kind nvidia-h200-x2)
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_session.sh pipeline-ab  (needs .ab_base/, below)
#   bash benchmarks/h200_session.sh startup-probe   (first on a fresh machine: import costs)
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_session.sh rl   (logprobs, n, sleep, weights)
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_session.sh cold-and-ab
#   bash benchmarks/h200_session.sh gpu-suite   (every GPU-marked test, then bf16 agreement)
#   bash benchmarks/h200_session.sh serve-engines   (serving: engine in a process vs a thread)
#   bash benchmarks/h200_session.sh soak   (the H200 soak: requests, minutes, slopes, leaks)
#   bash benchmarks/h200_session.sh dp-x2   (kind nvidia-h200-x2, carry .carry: DP=2 vs DP=1)
#   NANOVLLM_COMMIT=<hash> bash benchmarks/h200_session.sh same-run   (ours x 2 backends, upstream)
# ab-vs-base compares this tree with a worktree of a baseline commit: `git worktree add
# .ab_base <commit>; echo <commit> > .ab_base/.commit`, then carry [".device", ".ab_base"].
# Run with carry [".device"]; logs and JSON land in $OUT.
source .device/env.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
gpu_tests() {  # the GPU-marked tests within $1 seconds: log to $OUT, print the summary lines
  timeout "$1" python -m pytest -q -p no:cacheprovider -s -m gpu tests 2>&1 \
    | grep -vE "DEBUG|Writing|Loading" > $OUT/gpu_tests.log
  grep -E "passed|failed|argmax|relative error|^FAILED" $OUT/gpu_tests.log
}
case "${1:-tests-and-ab}" in
gpu-suite)
  # Every GPU-marked test (behaviour suite per target, float32 regression, random schedules,
  # parity), with per-test durations, then bf16 argmax agreement per backend and mode.
  timeout 360 python -m pytest -q -s -p no:cacheprovider -m gpu -rfEs --durations=15 tests 2>&1 \
    | grep -vE "DEBUG|Writing|Loading" > $OUT/gpu_suite.log
  grep -E "passed|failed|^(FAILED|ERROR|SKIPPED)|near-tie|TF32 attention" $OUT/gpu_suite.log
  timeout 200 python -m benchmarks.bf16_agreement --json $OUT/bf16_agreement.json 2>&1 \
    | grep -vE "Writing|Loading" | tee $OUT/bf16_agreement.log | tail -10
  ;;
tests-and-ab)
  # GPU parity (both backends, eager and graphs), sampler and graphs-vs-eager sampling checks.
  gpu_tests 240
  timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -1
  # Standard bench, flash-attn vs Triton alternated A B A B A B (one process per run).
  benchmarks/h200_ab.sh 3 "" "--attention-backend triton" 2>&1 | tee $OUT/ab.log | tail -4
  ;;
startup-and-scenarios)
  # Start-up with empty Inductor and Triton caches, then again with them warm.
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  for cache in cold warm; do
    timeout 120 python bench.py --random-weights --json $OUT/startup_$cache.json 2>&1 \
      | grep -E "^median" | sed "s/^/[$cache] /"
  done
  timeout 420 python bench.py --random-weights --scenario all --json $OUT/scenarios.json 2>&1 \
    | grep -vE "Writing|Loading"
  ;;
fa-and-scenarios)
  # The standard bench with flash-attn, 3 runs, then every scenario at full size.
  benchmarks/h200_ab.sh 3 "" 2>&1 | tee $OUT/ab.log | tail -2
  timeout 400 python bench.py --random-weights --scenario all --json $OUT/scenarios.json 2>&1 \
    | grep -vE "Writing|Loading"
  ;;
tp-x2)
  # On nvidia-h200-x2: TP=2 vs TP=1 parity (64 tokens x 8 prompts, logit error, clean
  # exit), then the tp scenario (standard bench at TP=1 and TP=2, memory per GPU).
  timeout 240 python -m benchmarks.tp_parity --random-weights --tp 2 --json $OUT/tp_parity.json \
    2>&1 | grep -vE "Writing|Loading"
  timeout 300 python bench.py --random-weights --scenario tp --json $OUT/tp.json 2>&1 \
    | grep -vE "Writing|Loading"
  echo "left after exit: $(ls /dev/shm | grep -c nanovllm) shm segments," \
    "$(pgrep -fc 'multiprocessing.spawn' || true) spawned processes"
  ;;
backends-and-eager)
  # flash-attn and Triton alternated on one machine, then one eager run.
  benchmarks/h200_ab.sh 2 "" "--attention-backend triton" 2>&1 | tee $OUT/ab.log | tail -3
  timeout 150 python bench.py --random-weights --enforce-eager --json $OUT/eager.json 2>&1 \
    | grep -E "^(run|median)"
  ;;
startup-probe)
  # Where import time goes on a fresh machine: torch alone, then nanovllm (top-level modules
  # by cumulative time), then CUDA initialisation.
  for mod in torch nanovllm; do
    python -X importtime -c "import $mod" 2> $OUT/importtime_$mod.txt
    echo "import $mod: $(tail -1 $OUT/importtime_$mod.txt | awk -F'|' '{printf "%.2f s", $2 / 1e6}')"
  done
  python - $OUT/importtime_nanovllm.txt <<'PY'
import sys
rows = [line.split("|") for line in open(sys.argv[1]) if line.startswith("import time:")][1:]
top = [(name.rstrip(), int(cum) / 1e6) for _, cum, name in rows if int(cum) > 2e5]
print(" ".join(f"{name.strip()}@{(len(name) - len(name.lstrip())) // 2} {s:.2f}" for name, s in top))
PY
  python -c "import time, torch; t = time.perf_counter(); torch.zeros(1, device='cuda');
print(f'CUDA init {time.perf_counter() - t:.2f} s')"
  ;;
cold-and-ab)
  # Start-up per backend with its own empty Triton/Inductor caches (run startup-probe first on
  # a fresh machine), then flash-attn vs Triton alternated with warm caches, then GPU tests.
  for backend in flash-attn triton; do
    TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 150 python bench.py \
      --random-weights --attention-backend $backend --json $OUT/cold_$backend.json 2>&1 \
      | grep -E "^median" | sed "s/^/[cold $backend] /"
  done
  benchmarks/h200_ab.sh 3 "" "--attention-backend triton" 2>&1 | tee $OUT/ab.log | tail -3
  gpu_tests 170
  timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -1
  ;;
pipeline-ab)
  # What pipelining gives: this tree pipelined, this tree lockstep (--no-pipeline) and the
  # baseline worktree, alternated A B C A B C A B C (flash-attn, one process per run).
  benchmarks/h200_ab.sh 3 "" "--no-pipeline" "@.ab_base" 2>&1 | tee $OUT/ab.log | tail -4
  ;;
ab-vs-base)
  # Empty compile caches: the first run (this tree, flash-attn) gives the cold start-up, the
  # second round's the warm one. Then GPU tests, then the new kernel tests.
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
  benchmarks/h200_ab.sh 3 "" "@.ab_base" "--attention-backend triton" 2>&1 \
    | tee $OUT/ab.log | tail -5
  # What the cold runs compiled (both trees): variants per Triton kernel, C launchers.
  echo "Triton variants: $(find $TRITON_CACHE_DIR -name '*.cubin' -printf '%f\n' | sort | uniq -c \
    | tr -s ' \n' ' ') | .so files: $(find $TRITON_CACHE_DIR -name '*.so' | wc -l)"
  gpu_tests 170
  timeout 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_sample.py \
    $(ls tests/kernels/test_qk_norm_rope.py tests/kernels/test_fused_ops.py 2>/dev/null) 2>&1 | tail -1
  ;;
rl)
  # RL features: their GPU tests (graphs, float32 parity), then bench.py --scenario rl: the
  # standard workload plain / logprobs=5 / n=4, memory after sleep(1) and sleep(2), wake_up
  # and update_weights times.
  timeout 150 python -m pytest -q -p no:cacheprovider -s tests/gpu/test_rl_gpu.py \
    tests/layers/test_sampler.py tests/layers/test_penalties.py 2>&1 | tail -3
  timeout 360 python bench.py --random-weights --scenario rl --json $OUT/rl.json 2>&1 \
    | grep -vE "Writing|Loading"
  ;;
serve-engines)
  # The serving benchmark at 4, 8, 16, 32 req/s and all at once, one server with the engine in
  # a process, then one with it in a thread, beside the offline figure (~6 minutes). Needs the
  # serve extra there: wheels in .whl/ for Python 3.12 (fastapi starlette uvicorn pydantic
  # pydantic_core annotated_types typing_inspection typing_extensions annotated_doc
  # opentelemetry_api; the rest is in the image), installed to /tmp/site first.
  timeout 560 python -m benchmarks.serve --random-weights --engine process,thread \
    --json $OUT/serve.json --plot $OUT/serve.png 2>&1 | grep -vE "Writing|Loading" | tail -18
  ;;
soak)
  # Thousands of random requests with injected interrupts in a small KV pool (~2 minutes): the
  # summary gives requests, minutes, host/GPU memory slopes and leaked blocks.
  timeout 200 python -m benchmarks.soak --random-weights --minutes 1.5 --json $OUT/soak.json \
    2>&1 | grep -vE "Writing|Loading" | tail -20
  ;;
dp-x2)
  # On nvidia-h200-x2: DP=2 vs DP=1 on 512 requests per backend, each engine warmed by one
  # untimed pass, 3 timed runs each. Ray travels as .carry/ray.tar.xz (Ray 2.60 for Python 3.12
  # minus jars, rllib, data, tune, train, serve, llm, plus jsonschema and its dependencies).
  mkdir -p /tmp/ray && tar -xJf .carry/ray.tar.xz -C /tmp/ray || exit 1
  export PYTHONPATH=".:/tmp/ray:${PYTHONPATH:-}"
  for backend in flash-attn triton; do
    timeout 280 python bench.py --random-weights --scenario dp --dp 2 --repeats 3 \
      --attention-backend $backend --json $OUT/dp_$backend.json 2>&1 \
      | grep -vE "Writing|Loading|INFO|WARNING" | tail -4
  done
  ;;
same-run)
  # The README's comparison: per round ours with Triton, ours with flash-attn, upstream
  # nano-vLLM's own bench, three rounds. env.sh above puts the flash-attn stand-in and the
  # project on PYTHONPATH: a command that resets PYTHONPATH loses flash-attn.
  python -c "import flash_attn" || exit 1
  for r in 1 2 3; do
    for backend in triton flash-attn; do
      timeout 100 python bench.py --random-weights --attention-backend $backend \
        --json $OUT/same_${backend}_$r.json 2>&1 | grep -E "^median" | sed "s/^/[$r $backend] /"
    done
    timeout 100 bash .device/bench_upstream.sh | sed "s/^/[$r upstream] /"
  done
  ;;
esac
