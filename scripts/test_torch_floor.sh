#!/usr/bin/env bash
# The tests that touch compile and tensor parallelism on the oldest supported PyTorch (2.11, what the GPU machines
# run; pyproject.toml declares the range): .ci/run runs this after scripts/test.sh (the newest, 2.13). torch 2.11
# once trained TP under --compile wrong while 2.13 was right (pytorch/pytorch#184113), which 2.13 alone never saw.
# PyPI serves 2.11 for Linux only as its CUDA build (2.6 GB of wheels, 4.6 GB installed; it runs on the CPU): its own
# environment, .venv-torch2.11, made once and kept (setup.sh's stamp). Measured on a 2-core machine: 2 min 20 s in all,
# 11 s of it the tests. tests/unit/test_tp_layers.py compiles every TP collective against eager (fails on 2.11
# without parallel.comm's views) and checks every TP layer; tests/unit/test_flat_blocks.py compiles a flat block's
# views + functional_call (--zero3-fetch flat) against eager; tests/integration/test_simulate_rank.py runs every mode
# over the simulated group, whose collectives 2.11's Dynamo traces only through parallel/simulated.py's registration.
# `--setup-only`: make the environment and stop (.ci/run makes it in the background while the other suites run: the
# install is mostly disk and network, not CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCH_FLOOR_VENV:-.venv-torch2.11}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PYTHON="$PWD/$VENV/bin/python" TORCH_SPEC=torch==2.11.0 bash scripts/setup.sh
[ "${1:-}" = "--setup-only" ] && exit 0
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} WANDB_SILENT=true PATH="$PWD/$VENV/bin:$PATH"
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.11.'), torch.__version__"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit/test_tp_layers.py tests/unit/test_flat_blocks.py \
  tests/integration/test_simulate_rank.py "$@"
