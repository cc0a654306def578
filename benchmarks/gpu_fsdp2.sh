#!/usr/bin/env bash
# FSDP2 beside DeepSpeed (--mode hybrid --zero-engine fsdp2) on 4 GPUs, one step per call (each under
# TOTAL_S, default 540 s), GPT-2 Large unless MODEL says otherwise:
#   OUT=/tmp/fsdp2-parity-large STEP=parity MODEL=gpt2-large bash benchmarks/gpu_fsdp2.sh
#   OUT=/tmp/fsdp2-parity-gpt2 STEP=parity MODEL=gpt2 bash benchmarks/gpu_fsdp2.sh
#       loss parity (python -m tools.parity) of the rows fsdp2-w4, fsdp2-compile-w4, fsdp2-tp2-w4,
#       fsdp2-tp2-compile-w4, and PARITY_EXTRA (default ddp-compile-w4 zero3-compile-w4: the verdicts of the speed
#       steps' DDP and ZeRO-3 rows), against single and its noise row at tools.parity's protocol for the model
#       (gpt2-large: global batch 32, micro-batch 2, 10 steps, lr 2.5e-4), 3 rows per GPU at once (the settings of
#       gpu_sweep.sh's PARITY_ROWS), WikiText-2 from .gpudata/
#       as benchmarks/gpu_parity.sh -> $OUT/parity/{parity.csv,parity.md,...}, $OUT/parity.log
#   OUT=/tmp/fsdp2-b8 STEP=b8 PARITY=/tmp/fsdp2-parity-large/parity/parity.csv bash benchmarks/gpu_fsdp2.sh
#       speed at batch 8 per GPU, in one call: SWEEP_MODES (default baseline hybrid fsdp2 fsdp2-tp2: DDP, ZeRO-3,
#       FSDP2, FSDP2 + TP2), all --compile, fused kernels none, seq 1024, bf16, synthetic tokens, 25 steps (10
#       warm-up), each row with the parity verdict of its configuration -> $OUT/sweep/{sweep.md,sweep.csv,report.md}
#   OUT=/tmp/fsdp2-max STEP=max PARITY=... INCLUDE="/tmp/fsdp2-b8/sweep/runs/*" bash benchmarks/gpu_fsdp2.sh
#       the largest batch that fits (MAX_BATCHES, default 48 32 24 16, tried largest first) for MAX_MODES (default
#       fsdp2 fsdp2-tp2), with the batch-8 runs of INCLUDE in its tables. The planner's peaks for GPT-2 Large on 4
#       GPUs (--plan --seq-len 1024 --zero-engine fsdp2 --compile, 4 blocks a unit): FSDP2 b8 19.3 GiB (17.1
#       measured on 4xH200), b32 60.1, b48 87.2; FSDP2 + TP2 b48 62.7 (61.8 measured at one block a unit), b64
#       82.1: on 80 GB cards b48 is one out-of-memory probe for FSDP2; on H200s (141 GB) pass
#       MAX_BATCHES="96 64 48 32"
# Row names are for NGPU GPUs (default 4; the parity rows are fsdp2-w$NGPU etc.). Needs .gpudata/ for STEP=parity.
# Every run's summary holds peak memory per GPU beside the planner's prediction (plan/peak_gib, plan/peak_error).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh  # PYTHON, and its torchrun first on PATH
gpt2_python_env
OUT=${OUT:?set OUT}
STEP=${STEP:?set STEP to parity, b8 or max}
MODEL=${MODEL:-gpt2-large}
NGPU=${NGPU:-4}
TOTAL_S=${TOTAL_S:-540}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} WANDB_MODE=disabled WANDB_SILENT=true PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
"$PYTHON" -c "import deepspeed" 2>/dev/null ||  # the DDP/ZeRO-3 rows; as gpu_parity.sh, from the carried .whl/
  "$PYTHON" -m pip install -q --no-index --find-links .whl deepspeed
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  "$PYTHON" -c "import torch, deepspeed; print('torch', torch.__version__, '| deepspeed', deepspeed.__version__)"; } |
  tee "$OUT/gpus.txt"

sweep() {  # sweep BATCHES MODES...: tools.train_sweep with the time left
  local batches=$1 left
  shift
  left=$((TOTAL_S - SECONDS - 20))
  echo "[${SECONDS}s] train sweep (batches $batches, modes $*) with ${left}s left"
  # shellcheck disable=SC2086
  "$PYTHON" -m tools.train_sweep --gpus "$NGPU" --model "$MODEL" --seq-len 1024 --steps 25 --warmup 10 \
    --modes "$@" --fused none --batches $batches --max-batches ${MAX_BATCHES:-48 32 24 16} --extra-args="--compile" \
    --run-timeout 200 --budget-s "$left" --out "$OUT/sweep" ${INCLUDE:+--include $INCLUDE} \
    ${PARITY:+--parity $PARITY} 2>&1 | tail -40
}

case "$STEP" in
  parity)
    # shellcheck disable=SC2086
    timeout --kill-after=15 "$((TOTAL_S - 20))" "$PYTHON" -m tools.parity --models "$MODEL" --jobs 3 \
      --run-timeout "$((TOTAL_S - 40))" --out "$OUT/parity" --data-path .gpudata/wikitext-2 \
      --tokenizer .gpudata/gpt2-tokenizer/tokenizer.json --cache-dir .gpudata/cache \
      --rows "fsdp2-w$NGPU" "fsdp2-compile-w$NGPU" "fsdp2-tp2-w$NGPU" \
      "fsdp2-tp2-compile-w$NGPU" ${PARITY_EXTRA-ddp-compile-w$NGPU zero3-compile-w$NGPU} >"$OUT/parity.log" 2>&1
    echo "[${SECONDS}s] parity rc=$?"
    grep -E " (pass|fail|error|skipped|reference|noise) " "$OUT/parity.log"
    tail -n 5 "$OUT/parity.log"
    ;;
  b8)
    # shellcheck disable=SC2086
    sweep 8 ${SWEEP_MODES:-baseline hybrid fsdp2 fsdp2-tp2}
    ;;
  max)
    # shellcheck disable=SC2086
    sweep max ${MAX_MODES:-fsdp2 fsdp2-tp2}
    ;;
  *)
    echo "STEP=$STEP: use parity, b8 or max" >&2
    exit 2
    ;;
esac
echo "[${SECONDS}s] done; results under $OUT"
