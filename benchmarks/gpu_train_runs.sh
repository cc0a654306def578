#!/usr/bin/env bash
# GPT-2 Large, seq 1024, bf16, synthetic data on NGPU GPUs: each run prints its summary line; at the end
# tools/report.py writes the comparison table (with the planner's predicted vs measured peak memory)
# and plots to $OUT/report.
#   NGPU=4 OUT=benchmarks/results/raw bash benchmarks/gpu_train_runs.sh "ddp-b8:--mode baseline --batch-size 8 --compile" ...
# Each argument is NAME:FLAGS. Defaults: DDP with --compile at 8/16/32, ZeRO-3 and ZeRO-3 + TP 2 at 8/32 (the
# planner's calibration matrix: the report's plan table shows predicted vs measured peak memory). With
# PARITY="a/parity.csv ..." each run's loss-parity verdict is printed and saved to $OUT/parity_verdicts.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh  # PYTHON, and its torchrun/deepspeed first on PATH
gpt2_python_env
# shellcheck source=benchmarks/run_names.sh
source benchmarks/run_names.sh
OUT=${OUT:-benchmarks/results/raw}
NGPU=${NGPU:-4}
STEPS=${STEPS:-25}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} WANDB_MODE=disabled PYTHONUNBUFFERED=1
mkdir -p "$OUT/runs"
runs=("$@")
if [ ${#runs[@]} -eq 0 ]; then
  runs=("ddp-b8:--mode baseline --batch-size 8 --compile"
        "ddp-b16:--mode baseline --batch-size 16 --compile"
        "ddp-b32:--mode baseline --batch-size 32 --compile"
        "zero3-b8:--mode hybrid --batch-size 8"
        "zero3-b32:--mode hybrid --batch-size 32"
        "zero3-tp2-b8:--mode hybrid --tp-size 2 --batch-size 8"
        "zero3-tp2-b32:--mode hybrid --tp-size 2 --batch-size 32")
fi
for spec in "${runs[@]}"; do
  name=$(free_run_name "$OUT" "$OUT/runs" "${spec%%:*}")  # a rerun gets NAME-1.log and runs/NAME-1
  flags=${spec#*:}
  # shellcheck disable=SC2086
  timeout "${RUN_TIMEOUT:-300}" "$PYTHON" -m torch.distributed.run --nproc_per_node="$NGPU" train.py \
    --model gpt2-large --seq-len 1024 --data synthetic --precision bf16 --max-steps "$STEPS" \
    --warmup-steps 5 --throughput-warmup-steps 10 --log-interval 5 --wandb disabled \
    --out-dir "$OUT/runs" --run-name "$name" $flags >"$OUT/$name.log" 2>&1
  echo "$name rc=$? $(grep -ho 'summary:.*' "$OUT/$name.log" | tail -1)"
  grep -hE "Error|error:|OutOfMemory" "$OUT/$name.log" | tail -3
done
"$PYTHON" -m tools.report "$OUT"/runs/* --out "$OUT/report"

# no speed without parity: each run's loss-parity verdict, from PARITY="a/parity.csv ..." (python -m tools.parity)
if [ -n "${PARITY:-}" ]; then
  # shellcheck disable=SC2086  # PARITY is a list of files
  "$PYTHON" -m tools.parity_verdict "$OUT/runs"/*/ --parity $PARITY | tee "$OUT/parity_verdicts.txt"
else
  echo "no PARITY=parity.csv given: these runs carry no loss-parity verdict (make one with the tools.parity module)"
fi
