"""The quick start on a stock Linux Python: scripts/python_env.sh picks one environment for every
script, scripts/setup.sh creates the project's .venv (clear errors before any download), and a fresh clone's
`bash scripts/demo.sh` / `bash scripts/test.sh` work with the distribution's externally managed Python (PEP 668).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = Path("/usr/bin/python3")
ENV_VARS = ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX", "USE_SYSTEM_PYTHON", "PYTHONPATH")  # what picks the env
MIN_PYTHON = re.search(r'^requires-python = ">=([\d.]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
# every script that runs the harness's Python, and so must take it from scripts/python_env.sh
RUNNERS = [ROOT / "scripts" / "demo.sh", ROOT / "scripts" / "test.sh", ROOT / "slurm" / "common.sh",
           *sorted((ROOT / "benchmarks").glob("gpu_*.sh"))]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without the variables that choose the environment (a test run may be inside a venv)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    return {**env, **extra}


def bash(script: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("script", RUNNERS, ids=lambda p: p.name)
def test_scripts_run_python_from_the_chosen_environment(script: Path) -> None:
    text = script.read_text()
    assert re.search(r"^\s*source .*scripts/python_env\.sh", text, re.M) and "gpt2_python_env" in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    bare = [line for line in code if re.search(r"(^|[\s;(|&!])(python3?|\$PY)(\s|$)", line)]
    assert not bare, f"{script.name} runs a Python that is not $PYTHON: {bare}"


@pytest.mark.parametrize("env, expected", [
    ({}, str(ROOT / ".venv" / "bin" / "python")),
    ({"PYTHON": "/opt/py/bin/python3", "VIRTUAL_ENV": "/v"}, "/opt/py/bin/python3"),
    ({"VIRTUAL_ENV": "/v", "CONDA_PREFIX": "/c", "USE_SYSTEM_PYTHON": "1"}, "/v/bin/python"),
    ({"CONDA_PREFIX": "/c", "USE_SYSTEM_PYTHON": "1"}, "/c/bin/python"),
    ({"USE_SYSTEM_PYTHON": "1"}, "python3"),
])
def test_environment_rules(env: dict[str, str], expected: str) -> None:
    out = bash('source scripts/python_env.sh; gpt2_choose_python; printf %s "$PYTHON"', **env)
    assert out.returncode == 0 and out.stdout == expected, out.stderr


def copy_scripts(repo: Path) -> Path:
    """The files setup.sh reads before it installs anything, in a repo of their own (no .venv)."""
    (repo / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "python_env.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    return repo


def test_python_env_puts_the_environment_first_on_path(tmp_path: Path) -> None:
    venv = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    out = bash('source scripts/python_env.sh; gpt2_python_env; printf "%s\\n%s" "$PYTHON" "${PATH%%:*}"',
               PYTHON=str(venv / "bin" / "python"))
    assert out.returncode == 0 and out.stdout.splitlines() == [str(venv / "bin" / "python"), str(venv / "bin")]

    repo = copy_scripts(tmp_path / "repo")  # before setup.sh made .venv: python3 from PATH, with a note
    out = bash('source scripts/python_env.sh; gpt2_python_env; printf %s "$PYTHON"', cwd=repo)
    assert out.returncode == 0 and out.stdout == "python3"
    assert f"no {repo / '.venv'} yet (bash scripts/setup.sh creates it)" in out.stderr


def fake_python3(tmp_path: Path, shadow: dict[str, str]) -> Path:
    """A bin folder whose python3 is this interpreter with modules shadowed (`name.py` -> source)."""
    (tmp_path / "shadow").mkdir()
    for name, source in shadow.items():
        (tmp_path / "shadow" / name).write_text(source)
    (tmp_path / "bin").mkdir()
    exe = tmp_path / "bin" / "python3"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "shadow"}" exec "{sys.executable}" "$@"\n')
    exe.chmod(0o755)
    return tmp_path / "bin"


@pytest.mark.parametrize("case", ["old_python", "no_venv_package"])
def test_setup_stops_early_with_a_clear_error(tmp_path: Path, case: str) -> None:
    """Before creating or downloading anything: a Python that is too old, Debian/Ubuntu without python3-venv."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if case == "old_python":  # what the check reads is sys.version_info
        shadow = {"sitecustomize.py": "import sys\nsys.version_info = (3, 9, 18, 'final', 0)\n"}
        expected = [f"is Python 3.9; the harness needs Python >= {MIN_PYTHON}", "python3.12 -m venv .venv"]
    else:  # Debian's python3.X without python3.X-venv has no ensurepip module
        shadow = {"ensurepip.py": "raise ModuleNotFoundError(\"No module named 'ensurepip'\")\n"}
        expected = ["cannot create a virtual environment", "apt install python3-venv", f"python{version}-venv"]
    repo = copy_scripts(tmp_path / "repo")
    bin_dir = fake_python3(tmp_path, shadow)
    start = time.perf_counter()
    out = bash("bash scripts/setup.sh", cwd=repo, PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert out.returncode != 0
    for text in expected:
        assert text in out.stderr, out.stderr
    assert not (repo / ".venv").exists() and time.perf_counter() - start < 30  # nothing made, nothing fetched


def externally_managed_python() -> str | None:
    """Why the quick-start test cannot run here, or None when /usr/bin/python3 is a PEP 668 Python with venv."""
    if not SYSTEM_PYTHON.exists():
        return f"no {SYSTEM_PYTHON}"
    probe = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys, sysconfig; print('%d.%d' % sys.version_info[:2],"
                            " sysconfig.get_path('stdlib'))"], capture_output=True, text=True)
    version, stdlib = probe.stdout.split()
    if not (Path(stdlib) / "EXTERNALLY-MANAGED").exists():
        return f"{SYSTEM_PYTHON} has no PEP 668 marker ({stdlib}/EXTERNALLY-MANAGED)"
    if tuple(map(int, version.split("."))) < tuple(map(int, MIN_PYTHON.split("."))):
        return f"{SYSTEM_PYTHON} is Python {version} < {MIN_PYTHON}"
    if subprocess.run([str(SYSTEM_PYTHON), "-c", "import venv, ensurepip"], capture_output=True).returncode:
        return f"{SYSTEM_PYTHON} lacks venv support (apt install python{version}-venv)"
    if shutil.which("git") is None:
        return "git is not installed"
    return None


@pytest.mark.slow
@pytest.mark.soak
def test_quickstart_from_a_fresh_clone_with_the_system_python(tmp_path: Path) -> None:
    """demo.sh then test.sh on a fresh clone, PATH=/usr/bin:/bin: a new .venv, a few steps, ruff + a test file.

    pip keeps this machine's configuration (pip.conf, PIP_* such as a local wheel folder): the test measures
    our scripts, not the network. The clone is of the committed HEAD.
    """
    reason = externally_managed_python()
    if reason:
        pytest.skip(reason)
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True, timeout=120)
    env = clean_env(PATH="/usr/bin:/bin", WANDB_MODE="disabled")

    def run(*cmd: str) -> subprocess.CompletedProcess:
        out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=540)
        assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    demo = run("bash", "scripts/demo.sh", "--max-steps", "3", "--eval-batches", "2", "--wandb", "disabled")
    assert f"creating {repo / '.venv'} with {SYSTEM_PYTHON}" in demo.stdout
    assert "summary: single gpt2-tiny" in demo.stderr + demo.stdout
    venv_python = repo / ".venv" / "bin" / "python"
    probe = run(str(venv_python), "-c", "import sys, torch; print(sys.base_prefix, torch.version.cuda)")
    base_prefix, cuda = probe.stdout.split()
    assert base_prefix == run(str(SYSTEM_PYTHON), "-c", "import sys; print(sys.prefix)").stdout.strip()
    if shutil.which("nvidia-smi") is None:
        assert cuda == "None"  # the CPU build of torch where there is no GPU
    assert run("git", "status", "--porcelain").stdout == ""  # .venv and the run folder are ignored

    start = time.perf_counter()
    again = run("bash", "scripts/setup.sh")
    assert "is up to date" in again.stdout and time.perf_counter() - start < 10  # nothing reinstalled
    tests = run("bash", "scripts/test.sh", "tests/unit/test_readme.py")
    assert re.search(r"\d+ passed", tests.stdout), tests.stdout
