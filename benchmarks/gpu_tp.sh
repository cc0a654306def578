#!/usr/bin/env bash
# Tensor parallelism on GPUs: the CPU/gloo correctness checks of tests/unit/test_tp_*.py over NCCL, then the
# overlap / sequence-parallel step-time benchmark. Needs 4 GPUs (the 2-GPU checks use the first two).
#   OUT=benchmarks/results/tp bash benchmarks/gpu_tp.sh
# Every check prints "OK: ..." or a traceback; the script ends with a pass/fail summary and exit code 1
# if any check failed. Logs and tp_overlap_tp{2,4}.csv land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh  # PYTHON, and its torchrun/deepspeed first on PATH
gpt2_python_env
OUT=${OUT:-benchmarks/results/tp}
MODEL=${MODEL:-gpt2-large}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
# queue each async input-gradient collective before the weight-gradient GEMM it should overlap with
export CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpus.txt"

fail=0
check() {  # check NPROC NAME TP
  local log="$OUT/check_$2_n$1_tp$3.log"
  timeout "${CHECK_TIMEOUT:-300}" "$PYTHON" -m torch.distributed.run --nproc_per_node="$1" \
    -m tests._tp_harness --check "$2" --tp "$3" >"$log" 2>&1
  local rc=$?
  echo "check $2 nproc=$1 tp=$3 rc=$rc $(grep -ho 'OK:.*' "$log" | tail -1)"
  [ $rc -eq 0 ] || { fail=1; grep -m3 -h "Error" "$log"; }
}
check 2 groups 2
check 2 layers 2
check 2 model 2
check 4 groups 2
check 4 layers 4
check 4 model 4
check 4 model 2   # TP=2 x DP=2

for tp in 2 4; do
  timeout "${BENCH_TIMEOUT:-600}" "$PYTHON" -m torch.distributed.run --nproc_per_node="$tp" -m benchmarks.tp_overlap \
    --tp "$tp" --model "$MODEL" --out "$OUT" >"$OUT/tp_overlap_tp$tp.log" 2>&1
  echo "tp_overlap tp=$tp rc=$?"; grep -h "^{" "$OUT/tp_overlap_tp$tp.log"
done
[ $fail -eq 0 ] && echo "ALL TP CHECKS PASSED" || echo "SOME TP CHECKS FAILED"
exit $fail
