#!/usr/bin/env bash
# ZeRO-3 vs DDP on 4 GPUs: GPT-2 Large, seq 1024, bf16, synthetic data, micro-batch 8 and 32 per GPU.
# Prints each run's summary line and the headline numbers (tokens/s, MFU, peak memory per GPU = max over ranks).
#
#   OUT=/tmp/out bash benchmarks/gpu_zero3.sh          # run folders under $OUT/runs
#
# A run that fails (e.g. DDP out of memory at batch 32 on 80 GB) is reported and the next one still runs.
# A short fp16 ZeRO-3 run (dynamic loss scaling) checks the fp16 path on real hardware. With PARITY="a/parity.csv ..."
# each run's loss-parity verdict is printed and saved to $OUT/parity_verdicts.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh  # PYTHON, and its torchrun/deepspeed first on PATH
gpt2_python_env
# shellcheck source=benchmarks/run_names.sh
source benchmarks/run_names.sh
OUT=${OUT:-benchmarks/results}
RUNS="$OUT/runs"
mkdir -p "$RUNS"
COMMON=(--model gpt2-large --seq-len 1024 --precision bf16 --data synthetic --max-steps 30 --log-interval 5
        --warmup-steps 5 --throughput-warmup-steps 5 --eval-batches 2 --wandb disabled --out-dir "$RUNS")

run() {  # run NAME ARGS...: one torchrun launch on 4 GPUs
  local name
  name=$(free_run_name "$RUNS" "$RUNS" "$1"); shift  # a rerun gets NAME-1.log and NAME-1/, never the old ones
  echo "=== $name: torchrun --nproc_per_node=4 train.py ${COMMON[*]} $*"
  # flags after COMMON win (argparse keeps the last value)
  if torchrun --nproc_per_node=4 --master_port=$((29500 + RANDOM % 1000)) train.py "${COMMON[@]}" "$@" \
      --run-name "$name" >"$RUNS/$name.log" 2>&1; then
    grep -h "summary:" "$RUNS/$name/console.log"
    "$PYTHON" - "$RUNS/$name/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "n/a"
print(f"  {s['mode']:8s} batch/gpu {s['batch_size_per_gpu']:3d} | {s['tokens_per_s']:,.0f} tok/s | MFU {mfu} | "
      f"peak alloc {s['mem/peak_allocated_gib']:.2f} GiB, reserved {s['mem/peak_reserved_gib']:.2f} GiB, "
      f"alloc retries {s['mem/alloc_retries']} | final loss {s['final_loss']:.4f} | val loss {s['val_loss']:.4f}")
EOF
  else
    echo "  FAILED (exit $?); last lines of $RUNS/$name.log:"
    grep -E "Error|error|out of memory" "$RUNS/$name.log" | tail -5
  fi
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PYTHON" -c "import torch, deepspeed; print('torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
run zero3-b8 --mode hybrid --zero-stage 3 --batch-size 8
run zero3-b32 --mode hybrid --zero-stage 3 --batch-size 32
run ddp-b8 --mode baseline --batch-size 8
run ddp-b32 --mode baseline --batch-size 32
run zero3-fp16-b8 --mode hybrid --zero-stage 3 --batch-size 8 --precision fp16 --max-steps 10

# no speed without parity: each run's loss-parity verdict, from PARITY="a/parity.csv ..." (python -m tools.parity)
if [ -n "${PARITY:-}" ]; then
  # shellcheck disable=SC2086  # PARITY is a list of files
  "$PYTHON" -m tools.parity_verdict "$RUNS"/*/ --parity $PARITY | tee "$OUT/parity_verdicts.txt"
else
  echo "no PARITY=parity.csv given: these runs carry no loss-parity verdict (make one with the tools.parity module)"
fi
