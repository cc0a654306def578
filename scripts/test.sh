#!/usr/bin/env bash
# Set up (scripts/setup.sh: the project's .venv unless an environment is active), then run ruff and the CPU
# test suite (multi-process gloo, DeepSpeed on CPU, Triton interpreter) with that environment's Python.
# GPU tests are marked `gpu` and skipped without CUDA; run them with `pytest -m gpu` on a GPU machine.
# Two pytest-xdist workers (TEST_WORKERS; 0 runs in one process), each taking whole files (--dist loadfile), so a
# module's trained runs are made once: most tests wait on one single-threaded train.py, leaving a core idle.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python_env.sh
gpt2_python_env
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} WANDB_SILENT=true
"$PYTHON" -m ruff check .
# the soak tier (tests marked `soak`, minutes each) is left out here; .ci/run runs it next with `-m soak` (a later
# -m given in "$@" replaces this one)
"$PYTHON" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile -m "not soak" "$@"
