#!/usr/bin/env bash
# GPU microbenchmark suite in one call (about 8 minutes, under a 10-minute limit):
#   1. GEMM ladder: build, probe and check every kernel, 4096^3 bf16 first, then the rest as time allows
#   2. per-op breakdown of gpt2-large, batch 8, seq 1024, bf16 (with profiler table and trace)
#   3. collectives + our ring all-reduce vs NCCL on 2 and on 4 GPUs (those that are visible)
# Results (CSV, PNG, markdown, logs) go to ${OUT:-benchmarks/results}. Every stage runs under its own
# time limit; one that fails or times out is logged in stages.txt and the next one still runs.
#
#   bash benchmarks/gpu_microbench.sh [--quick]          # STAGES="gemm micro coll" picks stages
set -u
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh  # PYTHON, and its torchrun/deepspeed first on PATH
gpt2_python_env
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
# NVLink multicast (NVLS) stays off on shared machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
QUICK=""
[[ "${1:-}" == "--quick" ]] && QUICK="--quick"
STAGES=${STAGES:-"gemm micro coll"}
NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} > "$OUT/env.txt"
cat "$OUT/env.txt"
: > "$OUT/stages.txt"

stage() {  # stage NAME LIMIT_S CMD...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/log_$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/stages.txt"
}

if [[ $STAGES == *gemm* ]]; then
  budget=160
  [[ -n $QUICK ]] && budget=100
  stage gemm 250 "$PYTHON" -m benchmarks.gemm.bench --out "$OUT" --time-budget-s $budget $QUICK
fi
if [[ $STAGES == *micro* ]]; then
  stage microbench 90 "$PYTHON" -m benchmarks.microbench --model gpt2-large --batch-size 8 --seq-len 1024 --dtype bf16 \
    --detailed --out "$OUT" --export-csv "$OUT/microbench_gpt2-large.csv"
fi
if [[ $STAGES == *coll* ]]; then
  for n in 2 4; do
    if (( NGPU >= n )); then
      stage "collectives_n$n" 90 torchrun --standalone --nproc_per_node=$n -m benchmarks.collectives --out "$OUT" $QUICK
    else
      echo "collectives_n$n skipped: $NGPU GPU(s) visible" | tee -a "$OUT/stages.txt"
    fi
  done
fi
echo "=== done in ${SECONDS}s; results in $OUT"
cat "$OUT/stages.txt"
