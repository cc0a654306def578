#!/usr/bin/env bash
# Fused kernels on a GPU in one call (stage limits 120 + 200 + 260 s: under a 10-minute limit):
#   1. build the CUDA bias+GELU extension (JIT, cached for the later stages)
#   2. the fused-kernel tests: every gpu-marked test (Triton + CUDA kernels at GPT-2 shapes, triton/cuda
#      training vs none in bf16, attention) plus the CPU-sized ones, here compiled on the GPU
#   3. benchmarks/kernels.py: eager vs torch.compile vs triton vs cuda, CSV + markdown table + targets
# Results go to ${OUT:-benchmarks/results}: kernels_env.txt, kernels_build.txt, kernels_tests.txt,
# kernels_bench.txt, kernels.csv, kernels.md. Each stage has its own time limit; one that fails or
# times out is logged and the next one still runs.
#
#   bash benchmarks/gpu_kernels.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-16}  # parallel nvcc/c++ jobs for the extension build

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  command -v nvcc && nvcc --version | tail -1
} > "$OUT/kernels_env.txt" 2>&1
cat "$OUT/kernels_env.txt"

stage() {  # stage NAME LIMIT_S LOG CMD...
  local name=$1 limit=$2 log=$3 start=$SECONDS
  shift 3
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  tail -n 60 "$OUT/$log"
  echo "=== $name rc=$rc $((SECONDS - start))s"
}

stage build 120 kernels_build.txt $PY -c \
  'import time; t = time.time(); from fused_kernels.cuda import load_extension; load_extension(); print(f"built in {time.time() - t:.0f}s")'
stage tests 200 kernels_tests.txt $PY -m pytest -q -p no:cacheprovider --durations=15 \
  tests/test_fused_triton.py tests/test_fused_cuda.py tests/test_fused_attention.py tests/test_fused_training.py
stage bench 260 kernels_bench.txt $PY -m benchmarks.kernels --out "$OUT" --compile-budget-s 120
echo "=== done in ${SECONDS}s; results in $OUT"
