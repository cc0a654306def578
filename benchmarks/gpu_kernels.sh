#!/usr/bin/env bash
# Fused kernels on a GPU in one call (stage limits 80 + 120 + 100 s: under 5 minutes):
#   1. build the CUDA bias+GELU extension (JIT, cached for the later stages)
#   2. the fused-kernel tests: every gpu-marked test (Triton + CUDA kernels at GPT-2 shapes, triton/cuda
#      training vs none in bf16, attention) plus the CPU-sized ones, here compiled on the GPU
#   3. benchmarks/kernels.py: eager vs torch.compile vs triton vs cuda, CSV + markdown table + targets;
#      --quick (the GPT-2 Large training shape of each kernel) unless BENCH_ARGS says otherwise
# Results go to ${OUT:-benchmarks/results}: kernels_env.txt, kernels_build.txt, kernels_tests.txt,
# kernels_bench.txt, kernels.csv, kernels.md. Each stage has its own time limit; one that fails or
# times out is logged and the next one still runs.
#
#   OUT=/tmp/k bash benchmarks/gpu_kernels.sh
#   STAGES="build tests" bash benchmarks/gpu_kernels.sh           # any subset of: build tests bench
#   BENCH_ARGS="--compile-budget-s 240" bash benchmarks/gpu_kernels.sh   # every shape (about 5 minutes alone)
set -u
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh  # PYTHON, and its torchrun/deepspeed first on PATH
gpt2_python_env
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
STAGES=${STAGES:-build tests bench}
BENCH_ARGS=${BENCH_ARGS:---quick --compile-budget-s 60}
export MAX_JOBS=${MAX_JOBS:-16}  # parallel nvcc/c++ jobs for the extension build

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  command -v nvcc && nvcc --version | tail -1
} > "$OUT/kernels_env.txt" 2>&1
cat "$OUT/kernels_env.txt"

# shellcheck source=benchmarks/stages.sh
source benchmarks/stages.sh  # stage NAME LIMIT_S LOG CMD...

stage build 80 kernels_build.txt "$PYTHON" -c \
  'import time; t = time.time(); from fused_kernels.cuda import load_extension; load_extension(); print(f"built in {time.time() - t:.0f}s")'
stage tests 120 kernels_tests.txt "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 \
  tests/unit/test_fused_triton.py tests/unit/test_fused_cuda.py tests/unit/test_fused_attention.py tests/unit/test_fused_training.py
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
stage bench 100 kernels_bench.txt "$PYTHON" -m benchmarks.kernels --out "$OUT" $BENCH_ARGS
echo "=== done in ${SECONDS}s; results in $OUT"
