#!/usr/bin/env bash
# 4 GPUs, about 9 minutes a call (TOTAL_S): GPT-2 Large, seq 1024, bf16, synthetic tokens.
#   1. what users run today (tools.hf_reference), HF_RUNS="MODE:BATCH ..." (default HF DDP and ZeRO-3 at
#      batch 8; "" skips), 25 steps each (5 warm-up) -> $OUT/hf/runs/*
#   2. TP scaling of our column/row-parallel layers at 1, 2 and 4 GPUs (benchmarks.tp_scaling; TP_SCALING=0 skips)
#      -> $OUT/tp_scaling
#   3. with the time left: our modes (SWEEP_MODES, default DDP, ZeRO-3, ZeRO-3 + TP2; hybrid-block and
#      hybrid-tp2-block add ZeRO-3 per block, the layout before flat 4-block units, beside them), all with --compile
#      (+ EXTRA),
#      at BATCHES (default "8 max"; max: the largest of MAX_BATCHES that fits), fused kernels FUSED (default "none
#      triton"), STEPS (25) of which WARMUP (10) untimed, each run at most RUN_TIMEOUT s (200: a cold compiled
#      ZeRO-3 run over 4-block units took 121 s on one H200 and over 109 s at TP 2, and a run killed mid-compile
#      leaves nothing cached for the next), in the time left
#      (tools.train_sweep --budget-s; NUMA=node: torchrun --numa-binding node for these runs),
#      with the HF runs and any run folders in INCLUDE added to its tables -> $OUT/sweep/{sweep.md,sweep.csv,...}
#   OUT=/tmp/out bash benchmarks/gpu_sweep.sh
#   OUT=/tmp/out2 HF_RUNS="" TP_SCALING=0 SWEEP_MODES="hybrid-tp2" INCLUDE="/tmp/out/sweep/runs/*" bash ...  # a 2nd call
# No speed without parity: PARITY="a/parity.csv [b/parity.csv]" (python -m tools.parity) gives each sweep row the
# loss-parity verdict of its configuration, and report.md keeps only the runs that pass; without it every row reads
# "unchecked". PARITY_ROWS="ddp-compile-w4 zero3-compile-w4 ..." runs those rows first, in the same call (gpt2-large
# at tools.parity's protocol for it, 3 rows per GPU, each run at most PARITY_S seconds (default 300) and the tool 60 s
# more, so that rows can exit and be judged (on a fresh 2-GPU machine two compiled ZeRO-3 rows finished just before
# the tool's limit, then their rows' own, and it wrote no verdict: benchmarks/results/parity/h200x2-2026-11-29/w2),
# needs .gpudata/ as benchmarks/gpu_parity.sh does), and adds its parity.csv to PARITY: a verdict from the same call
# as the speed.
# Issue-author numbers (4x H200) to compare stage 1 with: HF DDP b8 139.7k tok/s, b16 152.1k; HF ZeRO-3 b8 38.9k,
# b32 136.6k.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python_env.sh
source scripts/python_env.sh  # PYTHON, and its torchrun/deepspeed first on PATH
gpt2_python_env
# shellcheck source=benchmarks/run_names.sh
source benchmarks/run_names.sh
OUT=${OUT:-benchmarks/results/gpu_sweep}
NGPU=${NGPU:-4}
TOTAL_S=${TOTAL_S:-540}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} WANDB_MODE=disabled WANDB_SILENT=true PYTHONUNBUFFERED=1
mkdir -p "$OUT/hf/runs" "$OUT/tp_scaling"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
"$PYTHON" -c "import torch, transformers, deepspeed; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| deepspeed', deepspeed.__version__)" | tee -a "$OUT/gpus.txt"

if [ -n "${PARITY_ROWS:-}" ]; then
  # shellcheck disable=SC2086
  timeout $(( ${PARITY_S:-300} + 60 )) "$PYTHON" -m tools.parity --models gpt2-large --jobs 3 \
    --run-timeout "${PARITY_S:-300}" --out "$OUT/parity" --data-path .gpudata/wikitext-2 \
    --tokenizer .gpudata/gpt2-tokenizer/tokenizer.json --cache-dir .gpudata/cache --rows $PARITY_ROWS >"$OUT/parity.log" 2>&1
  echo "[${SECONDS}s] parity rc=$?"
  grep -E " (pass|fail|error|skipped|reference|noise) " "$OUT/parity.log"
  PARITY="${PARITY:-} $OUT/parity/parity.csv"  # train_sweep refuses it, naming it, if the parity run wrote none
fi

hf() {  # hf MODE BATCH
  local name
  name=$(free_run_name "$OUT/hf" "$OUT/hf/runs" "hf-$1-b$2")  # a rerun gets NAME-1.log and runs/NAME-1
  timeout 150 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" -m tools.hf_reference \
    --mode "$1" --model gpt2-large --seq-len 1024 --batch-size "$2" --max-steps 25 --throughput-warmup-steps 5 \
    --log-interval 5 --out-dir "$OUT/hf/runs" --run-name "$name" --wandb disabled >"$OUT/hf/$name.log" 2>&1
  echo "[${SECONDS}s] $name rc=$? $(grep -ho 'summary:.*' "$OUT/hf/$name.log" | tail -1)"
  grep -hE "Error|out of memory" "$OUT/hf/$name.log" | tail -2
}
for spec in ${HF_RUNS-ddp:8 zero3:8}; do
  hf "${spec%%:*}" "${spec#*:}"
done

if [ "${TP_SCALING:-1}" = 1 ]; then
  # overlap: queue each async input-gradient all-reduce before the weight-gradient GEMM it hides behind
  CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 200 "$PYTHON" -m benchmarks.tp_scaling --nprocs 1 2 4 --out "$OUT/tp_scaling" \
    >"$OUT/tp_scaling/tp_scaling.log" 2>&1
  echo "[${SECONDS}s] tp_scaling rc=$?"
  tail -31 "$OUT/tp_scaling/tp_scaling.log"
fi

left=$((TOTAL_S - SECONDS - 20))
echo "[${SECONDS}s] train sweep with ${left}s left"
if [ "$left" -gt 60 ]; then
  # shellcheck disable=SC2086
  "$PYTHON" -m tools.train_sweep --gpus "$NGPU" --model gpt2-large --seq-len 1024 --steps "${STEPS:-25}" \
    --warmup "${WARMUP:-10}" --modes ${SWEEP_MODES:-baseline hybrid hybrid-tp2} --fused ${FUSED:-none triton} \
    --batches ${BATCHES:-8 max} --max-batches ${MAX_BATCHES:-64 48 32 24 16} --extra-args="--compile ${EXTRA:-}" \
    --run-timeout "${RUN_TIMEOUT:-200}" --budget-s "$left" --out "$OUT/sweep" \
    --include "$OUT"/hf/runs/* ${INCLUDE:-} ${PARITY:+--parity $PARITY} ${NUMA:+--numa-binding $NUMA} 2>&1 | tail -40
fi
echo "[${SECONDS}s] done; results under $OUT"
