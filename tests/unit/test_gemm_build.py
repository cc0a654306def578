"""The GEMM ladder's CUDA kernels compile for sm_80 and sm_90 (the wgmma kernels for sm_90a) without register
spills (nvcc only, no GPU); on a Hopper GPU the wgmma kernels match torch.matmul."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fused_kernels.cuda.mlp import SOURCE_DIR as CUDA_DIR
from fused_kernels.cuda.mlp import hopper

GEMM_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "gemm"  # the ladder's steps 1-5; the rest: CUDA_DIR


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_gemm_kernels_compile_without_spills(tmp_path):
    cmd = ["nvcc", "-c", "-std=c++17", "-O3", "-Xptxas", "-v", "-gencode=arch=compute_80,code=sm_80",
           "-gencode=arch=compute_90,code=sm_90", "-I", str(CUDA_DIR), str(GEMM_DIR / "gemm_kernels.cu"), "-o",
           str(tmp_path / "g.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    kernels = re.findall(r"Function properties for (\S+)", r.stderr)
    assert sum("mma_kernelI" in k for k in kernels) == 4  # two tile-shape instantiations x two architectures
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and not any(spills), r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_wgmma_kernel_compiles_for_sm90a_without_spills(tmp_path):
    cmd = ["nvcc", "-c", "-std=c++17", "-O3", "-Xptxas", "-v", "-gencode=arch=compute_90a,code=sm_90a",
           str(CUDA_DIR / "gemm_wgmma.cu"), "-o", str(tmp_path / "w.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    kernels = re.findall(r"Function properties for (\S+)", r.stderr)
    assert len(kernels) == 1 and "wgmma_kernel" in kernels[0], r.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and not any(spills), r.stderr
    # ptxas says so when it has to serialise the wgmmas (accumulators touched inside the async window)
    assert "Potential Performance Loss" not in r.stderr, r.stderr
    # setmaxnreg moves 128 x (168 - 40) registers from the producer warpgroup to the two consumer warpgroups
    # (232 each): that only balances if the kernel is allocated the full 65536 / 384 -> 168 per thread
    assert re.findall(r"Used (\d+) registers", r.stderr) == ["168"], r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_wgmma_persistent_kernel_compiles_for_sm90a_without_spills(tmp_path):
    """All four instantiations (plain, bias_gelu, bias_gelu_aux, dgelu), with the flags bench.py builds them with."""
    cmd = ["nvcc", "-c", "-std=c++17", "-O3", "-lineinfo", "-Xptxas", "-v", "-gencode=arch=compute_90a,code=sm_90a",
           str(CUDA_DIR / "gemm_wgmma_persistent.cu"), "-o", str(tmp_path / "p.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr
    kernels = re.findall(r"Function properties for (\S+)", r.stderr)
    assert len(kernels) == 4 and all("wgmma_persistent_kernel" in k for k in kernels), r.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and not any(spills), r.stderr
    assert "Potential Performance Loss" not in r.stderr, r.stderr
    assert re.findall(r"Used (\d+) registers", r.stderr) == ["168"] * 4, r.stderr  # see the wgmma test


HOPPER = hopper()


@pytest.fixture(scope="module")
def hopper_ext():
    from benchmarks.gemm.bench import HOPPER_KERNELS, build_extension

    return build_extension(kernels=HOPPER_KERNELS)


@pytest.fixture(scope="module")
def wgmma(hopper_ext):
    return hopper_ext["wgmma"]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("M,N,K", [(128, 256, 64), (256, 512, 128), (256, 512, 320), (4096, 4096, 4096)])
def test_wgmma_matches_torch(wgmma, M, N, K):
    from benchmarks.gemm.bench import Shape, check

    err = check(wgmma, Shape("t", M, N, K), seed=M + N + K)[0]  # C starts NaN: an unwritten output fails
    assert err <= 1e-2, f"relative Frobenius error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_wgmma_rejects_shapes_off_the_tile(wgmma):
    A = torch.zeros(128, 64, device="cuda", dtype=torch.bfloat16)
    B = torch.zeros(64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="N % 256"):
        wgmma(A, B, torch.empty(128, 128, device="cuda", dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("M,N,K", [(128, 256, 64), (256, 512, 320), (2048, 4096, 320), (4096, 4096, 4096),
                                   (8192, 50304, 1280),  # lm_head: N's last tile is half outside C
                                   (2000, 4104, 328), (100, 8, 8), (1950, 1288, 72)])  # off the tile in M, N, K
def test_wgmma_persistent_matches_torch(hopper_ext, M, N, K):
    from benchmarks.gemm.bench import Shape, check

    err = check(hopper_ext["wgmma_persistent"], Shape("t", M, N, K), seed=M + N + K)[0]  # C starts NaN
    assert err <= 1e-2, f"relative Frobenius error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("M,N,K", [(8192, 5120, 1280), (1950, 1288, 72)])
def test_wgmma_persistent_bias_gelu_matches_torch(hopper_ext, M, N, K):
    from benchmarks.gemm.bench import gelu_tanh, relative_error

    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    A = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    B = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
    C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    hopper_ext["wgmma_persistent_bias_gelu"](A, B, bias, C)
    assert relative_error(C, gelu_tanh(A.double() @ B.double() + bias.double())) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_wgmma_persistent_rejects_unaligned_strides(hopper_ext):
    A = torch.zeros(128, 64, device="cuda", dtype=torch.bfloat16)
    B = torch.zeros(64, 100, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="N % 8"):
        hopper_ext["wgmma_persistent"](A, B, torch.empty(128, 100, device="cuda", dtype=torch.bfloat16))
