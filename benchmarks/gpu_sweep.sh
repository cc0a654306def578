#!/usr/bin/env bash
# 4 GPUs, about 9 minutes in all (TOTAL_S): GPT-2 Large, seq 1024, bf16, synthetic tokens.
#   1. what users run today (benchmarks.hf_reference): HF DDP at batch 8 and 16, HF ZeRO-3 at batch 8 and 32,
#      25 steps each (5 warm-up) -> $OUT/hf/runs/*
#   2. TP scaling of our column/row-parallel layers at 1, 2 and 4 GPUs (benchmarks.tp_scaling) -> $OUT/tp_scaling
#   3. with the time left: our modes (DDP, ZeRO-3, ZeRO-3 + TP2) at batch 8, fused kernels none then triton, then
#      the largest batch that fits (benchmarks.train_sweep --budget-s), the HF runs included in its tables
#      -> $OUT/sweep/{sweep.md,sweep.csv,report.md,*.png}
#   OUT=/tmp/out bash benchmarks/gpu_sweep.sh
# Issue-author numbers (4x H200) to compare stage 1 with: HF DDP b8 139.7k tok/s, b16 152.1k; HF ZeRO-3 b8 38.9k,
# b32 136.6k.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_sweep}
NGPU=${NGPU:-4}
TOTAL_S=${TOTAL_S:-540}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} WANDB_MODE=disabled WANDB_SILENT=true PYTHONUNBUFFERED=1
mkdir -p "$OUT/hf/runs" "$OUT/tp_scaling"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| deepspeed', deepspeed.__version__)" | tee -a "$OUT/gpus.txt"

hf() {  # hf MODE BATCH
  local name="hf-$1-b$2"
  timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" -m benchmarks.hf_reference \
    --mode "$1" --model gpt2-large --seq-len 1024 --batch-size "$2" --max-steps 25 --throughput-warmup-steps 5 \
    --log-interval 5 --out-dir "$OUT/hf/runs" --run-name "$name" --wandb disabled >"$OUT/hf/$name.log" 2>&1
  echo "[${SECONDS}s] $name rc=$? $(grep -ho 'summary:.*' "$OUT/hf/$name.log" | tail -1)"
  grep -hE "Error|out of memory" "$OUT/hf/$name.log" | tail -2
}
hf ddp 8
hf ddp 16
hf zero3 8
hf zero3 32

# overlap: queue each async input-gradient all-reduce before the weight-gradient GEMM it hides behind
CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 200 python3 -m benchmarks.tp_scaling --nprocs 1 2 4 --out "$OUT/tp_scaling" \
  >"$OUT/tp_scaling/tp_scaling.log" 2>&1
echo "[${SECONDS}s] tp_scaling rc=$?"
tail -31 "$OUT/tp_scaling/tp_scaling.log"

left=$((TOTAL_S - SECONDS - 20))
echo "[${SECONDS}s] train sweep with ${left}s left"
if [ "$left" -gt 60 ]; then
  python3 -m benchmarks.train_sweep --gpus "$NGPU" --model gpt2-large --seq-len 1024 --steps 25 --warmup 10 \
    --modes baseline hybrid hybrid-tp2 --fused none triton --batches 8 max --max-batches 64 48 32 24 16 \
    --run-timeout 150 --budget-s "$left" --out "$OUT/sweep" \
    --include "$OUT"/hf/runs/hf-{ddp-b8,ddp-b16,zero3-b8,zero3-b32} 2>&1 | tail -40
fi
echo "[${SECONDS}s] done; results under $OUT"
