#!/usr/bin/env bash
# Install the harness and its dependencies into the current Python environment.
# Keeps an existing PyTorch; without one it installs $TORCH_SPEC (default torch==2.13.0).
# DeepSpeed ships as an sdist: it is built with --no-build-isolation so that its build
# sees the installed torch instead of pulling another (possibly CUDA) torch into an isolated env.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if ! "$PY" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
fi
if [ "$(uname -s)" = Linux ] && ! "$PY" -c "import triton" 2>/dev/null; then
  "${PIP[@]}" "${TRITON_SPEC:-triton==3.6.0}"
fi
"${PIP[@]}" setuptools wheel
DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation -e ".[dev]"
