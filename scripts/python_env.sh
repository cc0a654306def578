# shellcheck shell=bash
# The Python environment the harness runs in, chosen the same way by every script: sourced (not run) by
# scripts/{setup,demo,test}.sh, slurm/common.sh and benchmarks/gpu_*.sh. The first rule that applies:
#   PYTHON=/path/to/python   that interpreter, as it is
#   an active virtual environment ($VIRTUAL_ENV) or conda environment ($CONDA_PREFIX): its python
#   USE_SYSTEM_PYTHON=1      python3 from PATH (you manage its packages)
#   otherwise                the project's .venv at the repository root (scripts/setup.sh creates it)

GPT2_VENV="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv"

# gpt2_choose_python: set PYTHON by the rules above (scripts/setup.sh creates a missing .venv).
gpt2_choose_python() {
  if [ -n "${PYTHON:-}" ]; then
    return
  elif [ -n "${VIRTUAL_ENV:-}" ]; then
    PYTHON="$VIRTUAL_ENV/bin/python"
  elif [ -n "${CONDA_PREFIX:-}" ]; then
    PYTHON="$CONDA_PREFIX/bin/python"
  elif [ "${USE_SYSTEM_PYTHON:-0}" = 1 ]; then
    PYTHON=python3
  else
    PYTHON="$GPT2_VENV/bin/python"
  fi
}

# gpt2_python_env: choose PYTHON and export it, with its scripts folder first on PATH, so that torchrun,
# deepspeed, pytest and ruff come from the same environment (also through srun, which passes PATH on).
gpt2_python_env() {
  gpt2_choose_python
  if [ "$PYTHON" = "$GPT2_VENV/bin/python" ] && [ ! -x "$PYTHON" ]; then
    echo "python_env: no $GPT2_VENV yet (bash scripts/setup.sh creates it): using python3 from PATH" >&2
    PYTHON=python3
  fi
  local scripts
  scripts=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))') || {
    echo "python_env: cannot run PYTHON=$PYTHON" >&2
    return 1
  }
  PATH="$scripts:$PATH"
  export PYTHON PATH
}
