#!/usr/bin/env bash
# Install the harness and its dependencies into its Python environment (scripts/python_env.sh picks it: an
# active venv/conda env, PYTHON=, USE_SYSTEM_PYTHON=1, else .venv at the repository root, created here with
# python3 from PATH, so that a distribution's externally managed Python (PEP 668) is never touched).
# Keeps an existing PyTorch; without one it installs $TORCH_SPEC (default torch==2.13.0).
# DeepSpeed ships as an sdist: it is built with --no-build-isolation so that its build
# sees the installed torch instead of pulling another (possibly CUDA) torch into an isolated env.
# A re-run installs nothing when nothing changed: the environment keeps a stamp, the hash of this script,
# python_env.sh, pyproject.toml, the specs and the repository path (delete it to force a reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TRITON_SPEC=${TRITON_SPEC:-triton==3.6.0}
MIN_PYTHON=$(sed -n 's/^requires-python = ">=\([0-9.]*\)"$/\1/p' pyproject.toml)  # the one place it is stated

die() {
  echo "setup.sh: error: $*" >&2
  exit 1
}

# check_python PY: PY runs and is new enough (before anything is created or downloaded)
check_python() {
  local version
  version=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "cannot run $1"
  "$1" -c "import sys; sys.exit(sys.version_info[:2] < tuple(map(int, '$MIN_PYTHON'.split('.'))))" ||
    die "$1 is Python $version; the harness needs Python >= $MIN_PYTHON. Install a newer one and make the" \
        "environment with it (e.g. python3.12 -m venv .venv, then run this again), or pass PYTHON=<its path>"
  echo "$version"
}

gpt2_choose_python
if [ "$PYTHON" = "$GPT2_VENV/bin/python" ] && [ ! -e "$GPT2_VENV" ]; then
  command -v python3 >/dev/null || die "no python3 on PATH: install Python >= $MIN_PYTHON"
  base=$(command -v python3)
  version=$(check_python "$base")
  # Debian/Ubuntu ship venv's ensurepip in a separate package; without it `python3 -m venv` fails halfway
  "$base" -c 'import venv, ensurepip' 2>/dev/null ||
    die "$base (Python $version) cannot create a virtual environment: its venv/ensurepip modules are missing." \
        "On Debian/Ubuntu: sudo apt install python3-venv (or python$version-venv). Or activate an environment" \
        "of your own, or set USE_SYSTEM_PYTHON=1 to install into $base itself"
  echo "setup: creating $GPT2_VENV with $base (Python $version)"
  "$base" -m venv "$GPT2_VENV" || { rm -rf "$GPT2_VENV"; die "$base -m venv $GPT2_VENV failed"; }
elif [ "$PYTHON" = "$GPT2_VENV/bin/python" ] && [ ! -x "$PYTHON" ]; then
  die "$GPT2_VENV has no bin/python: delete it and run again"
fi
check_python "$PYTHON" >/dev/null

# the stamp lives in the environment (a venv or conda env; never a system prefix), so a new env has none
stamp_dir=$("$PYTHON" -c 'import os, sys
print(sys.prefix if sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, "conda-meta")) else "")')
stamp=${stamp_dir:+$stamp_dir/.gpt2-setup-stamp}
want=$({ cat scripts/setup.sh scripts/python_env.sh pyproject.toml; echo "$TORCH_SPEC $TRITON_SPEC $PWD"; } |
       "$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
if [ -n "$stamp" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "setup: $stamp_dir is up to date"
  exit 0
fi

PIP=("$PYTHON" -m pip install -q --disable-pip-version-check)
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "$TORCH_SPEC"
fi
if [ "$(uname -s)" = Linux ] && ! "$PYTHON" -c "import triton" 2>/dev/null; then
  "${PIP[@]}" "$TRITON_SPEC"
fi
"${PIP[@]}" setuptools wheel
# the editable install writes the repository's .egg-info: environments of one checkout made at once (.ci/run makes
# .venv and .venv-torch2.11 side by side) take turns here, locking the repository folder (flock: util-linux)
lock=()
if command -v flock >/dev/null; then
  lock=(flock .)
fi
DS_BUILD_OPS=0 ${lock[@]+"${lock[@]}"} "${PIP[@]}" --no-build-isolation -e ".[dev]"
if [ -n "$stamp" ]; then
  echo "$want" >"$stamp"
fi
echo "setup: installed into ${stamp_dir:-the environment of $PYTHON}"
