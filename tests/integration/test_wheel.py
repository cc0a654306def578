"""The installed distribution is the library alone with its console script, `gpt2-train`, which trains from outside
the checkout (and so does the checkout's train.py shim, copied out).

The wheel is built from a copy of the sources (the checkout gets no build/ or .egg-info) and installed with
`pip install --target` into a temporary folder. Python then runs with `-S`: no site-packages processing, so neither
the checkout's editable install nor any .pth file applies; the path is the installed folder and, for torch and the
other dependencies, this environment's site-packages. The checkout is on no path: what imports, imports from the
wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

from tests.train_runs import TINY_ARGS

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = {"gpt2", "parallel", "fused_kernels"}
SOURCES = ("pyproject.toml", "README.md", *LIBRARY, "tools", "benchmarks")  # tools/benchmarks: to see them left out

# run under `python -S` from the installed folder: the library, its package data and nothing of the checkout
CHECK = """
import importlib.util, sys
from importlib import metadata
from pathlib import Path
import gpt2, parallel, fused_kernels
from gpt2.config.cli import parse_args
from gpt2.config.layout import RunLayout
from gpt2.runtime.torch_support import supported_torch
target, root = sys.argv[1], sys.argv[2]
assert not any(p and Path(p).resolve() == Path(root) for p in sys.path), sys.path
for module in (gpt2, parallel, fused_kernels):
    assert module.__file__.startswith(target), module.__file__
for name in ("tools", "benchmarks", "train"):
    spec = importlib.util.find_spec(name)
    assert spec is None or not str(spec.origin).startswith((target, root)), (name, spec)
assert Path(metadata.distribution("gpt2-hybrid-parallel").locate_file("gpt2")).resolve() == Path(target, "gpt2")
assert str(supported_torch())  # the torch range from the installed metadata: no pyproject.toml beside the package
layout = RunLayout.resolve(parse_args(["--mode", "hybrid", "--device", "cpu"]), 1, "cpu")  # reads zero3.json
assert layout.ds_file["zero_optimization"]["stage"] == 3
from fused_kernels.cuda import SOURCES
from fused_kernels.cuda.mlp import WGMMA_SOURCES
for source in (*SOURCES, *WGMMA_SOURCES):  # what load() compiles: inside the installed package
    assert source.is_file() and source.is_relative_to(Path(target).resolve()), source
"""


def test_the_wheel_holds_the_library_and_gpt2_train_runs_on_it(tmp_path: Path) -> None:
    src, dist, target, work = (tmp_path / name for name in ("src", "dist", "target", "work"))
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)], check=True,
                   capture_output=True, timeout=300)
    (wheel,) = dist.glob("*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=300)

    top_level = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert top_level == LIBRARY
    script = target / "bin" / "gpt2-train"  # pip's wrapper of [project.scripts]: imports gpt2.train.main, calls cli
    assert "from gpt2.train.main import cli" in script.read_text()
    assert sorted(p.name for p in (target / "gpt2/config/ds_configs").glob("*.json")) == [
        "zero1.json", "zero2.json", "zero3.json"]
    # the CUDA sources the library builds from (fused_kernels.cuda and .mlp), each with the headers it includes
    cuda = target / "fused_kernels/cuda"
    built = ["bias_gelu.cu", "bias_gelu.cpp", "gemm_wgmma.cu", "gemm_wgmma_persistent.cu", "gemm_binding.cpp"]
    for name in built:
        assert (cuda / name).is_file(), name
        for header in re.findall(r'^#include "([^"]+)"', (cuda / name).read_text(), flags=re.MULTILINE):
            assert (cuda / header).is_file(), (name, header)

    work.mkdir()
    shutil.copy2(ROOT / "train.py", work / "train.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join([str(target), *site.getsitepackages()]), OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu", WANDB_SILENT="true", TOKENIZERS_PARALLELISM="false")
    python = [sys.executable, "-S"]
    check = subprocess.run([*python, "-c", CHECK, str(target), str(ROOT)], cwd=work, env=env, capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    shim = subprocess.run([*python, "train.py", "--help"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert shim.returncode == 0 and "--mode" in shim.stdout, shim.stderr
    # the installed entry, under the same -S interpreter (its shebang's would process this environment's .pth files)
    run = subprocess.run([*python, str(script), *TINY_ARGS, "--data", "synthetic", "--max-steps", "2",
                          "--eval-batches", "0", "--out-dir", str(work / "runs")], cwd=work, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert list((work / "runs").glob("*/summary.json")), "the run wrote no summary"
