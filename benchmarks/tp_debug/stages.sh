#!/usr/bin/env bash
# Where does TP=2 stall on CUDA? On nvidia-h200-x2, carry [".device"]:
#   bash benchmarks/tp_debug/stages.sh
# Each stage starts one TP=2 engine (75 s limit); when one fails, every process's stacks (from
# sitecustomize.py) and NCCL's warnings are printed. Eager first, then CUDA graphs; a failing
# stage is retried with the usual suspects changed (P2P off; cuMem off; capture mode).
source .device/env.sh
export PYTHONPATH=$PWD/benchmarks/tp_debug:$PYTHONPATH NANOVLLM_DUMP=$OUT DUMP_AFTER=45 \
  PYTHONUNBUFFERED=1 NCCL_DEBUG=INFO NCCL_DEBUG_FILE=$OUT/nccl.%p.log
nvidia-smi topo -m 2>&1 | head -4
stage() {  # stage NAME MODE [ENV=VALUE...]
  local name=$1 mode=$2; shift 2
  echo "=== $name ($*)"
  env "$@" timeout -k 5 75 python benchmarks/tp_debug/one_engine.py $mode 2>&1 \
    | grep -vE "Writing|Loading" | tail -12
  local rc=${PIPESTATUS[0]}; echo "rc=$rc"
  pkill -9 -f multiprocessing-fork; sleep 1
  mkdir -p $OUT/$name; mv $OUT/stack.* $OUT/nccl.* $OUT/$name/ 2>/dev/null
  if [ $rc != 0 ]; then
    for f in $OUT/$name/stack.*; do
      [ -s $f ] && { echo "--- $f"; awk '/^Timeout/{n++} n==1' $f | grep -E "File|Thread" | head -16; }
    done
    grep -h "WARN\|Channel 00" $OUT/$name/nccl.* | head -6
  fi
  return $rc
}
if stage eager eager X=1; then
  stage graphs graphs X=1 || { stage graphs-threadlocal graphs DBG_CAPTURE_MODE=thread_local
                               stage graphs-nocumem graphs NCCL_CUMEM_ENABLE=0; }
else
  stage eager-nop2p eager NCCL_P2P_DISABLE=1 && stage graphs-nop2p graphs NCCL_P2P_DISABLE=1
fi
