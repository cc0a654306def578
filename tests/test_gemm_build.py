"""The GEMM ladder's CUDA kernels compile for sm_80 and sm_90 without register spills (nvcc only, no GPU)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

GEMM_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gemm"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_gemm_kernels_compile_without_spills(tmp_path):
    cmd = ["nvcc", "-c", "-std=c++17", "-O3", "-Xptxas", "-v", "-gencode=arch=compute_80,code=sm_80",
           "-gencode=arch=compute_90,code=sm_90", str(GEMM_DIR / "gemm_kernels.cu"), "-o", str(tmp_path / "g.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    kernels = re.findall(r"Function properties for (\S+)", r.stderr)
    assert sum("mma_kernelI" in k for k in kernels) == 4  # two tile-shape instantiations x two architectures
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and not any(spills), r.stderr
