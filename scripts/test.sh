#!/usr/bin/env bash
# Set up, then run the CPU test suite (multi-process gloo, DeepSpeed on CPU, Triton interpreter).
# GPU tests are marked `gpu` and skipped without CUDA; run them with `pytest -m gpu` on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} WANDB_SILENT=true
ruff check .
python3 -m pytest -q "$@"
