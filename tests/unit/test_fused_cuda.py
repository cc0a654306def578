"""The CUDA C++ bias+GELU kernel: it compiles for sm_80 and sm_90 with 16-byte vector loads (CPU, needs
nvcc), and on a GPU it matches an fp64 reference, forward and backward, on vectorised and scalar paths."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from fused_kernels import KernelUnavailableError, get_ops, reference
from fused_kernels.cuda import NVCC_FLAGS, SOURCE_DIR
from tests._fused_helpers import DTYPE_TOLS, GPU, assert_close, poison  # noqa: F401 (fixture)

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


@needs_nvcc
def test_cu_compiles_for_sm80_and_sm90(tmp_path):
    cmd = [NVCC, "-c", str(SOURCE_DIR / "bias_gelu.cu"), "-o", str(tmp_path / "bias_gelu.o"), "-std=c++17",
           *NVCC_FLAGS]
    subprocess.run(cmd, check=True, capture_output=True)


@needs_nvcc
def test_cu_tanh_is_exact_for_fp32_and_approximate_for_16_bit(tmp_path):
    """fp32 kernels must not use tanh.approx (~2^-11 relative error: it failed the fp32 dx check on an H200);
    fp16/bf16 kernels use it, as their own rounding is as coarse."""
    ptx = tmp_path / "bias_gelu.ptx"
    flags = [f for f in NVCC_FLAGS if not f.startswith("-gencode")]
    subprocess.run([NVCC, "-ptx", str(SOURCE_DIR / "bias_gelu.cu"), "-o", str(ptx), "-std=c++17", *flags,
                    "-arch=sm_90"], check=True, capture_output=True)
    entries = ptx.read_text().split(".entry ")[1:]  # one chunk per kernel instantiation, mangled name first
    by_type = {"fp32": [e for e in entries if "_kernelIf" in e.split("(")[0]],
               "16-bit": [e for e in entries if "_kernelI6__half" in e.split("(")[0]
                          or "_kernelI13__nv_bfloat16" in e.split("(")[0]]}
    assert len(by_type["fp32"]) == 4 and len(by_type["16-bit"]) == 8, [e.split("(")[0] for e in entries]
    assert not any("tanh.approx" in e for e in by_type["fp32"])
    assert all("tanh.approx.f32" in e for e in by_type["16-bit"])


@needs_nvcc
def test_cu_uses_16_byte_loads_and_stores(tmp_path):
    ptx = tmp_path / "bias_gelu.ptx"
    subprocess.run([NVCC, "-ptx", str(SOURCE_DIR / "bias_gelu.cu"), "-o", str(ptx), "-std=c++17", "-O3",
                    "-arch=sm_90"], check=True, capture_output=True)
    text = ptx.read_text()
    assert "ld.global.nc.v4.f32" in text and "ld.global.nc.v4.u32" in text  # fp32 and 16-bit packs
    assert "st.global.v4" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_backend_without_gpu_is_a_clear_error():
    with pytest.raises(KernelUnavailableError, match="CUDA GPU"):
        get_ops("cuda")


@pytest.mark.parametrize("dtype,tol", DTYPE_TOLS)
@pytest.mark.parametrize("shape,offset", [
    ((37, 129), 0),  # N not a multiple of the pack: scalar path
    ((8, 1024, 1280), 0),  # vectorised path
    ((4, 64), 1),  # vector-friendly N but misaligned pointers: scalar path
    ((8, 1024, 5120), 0),
])
@pytest.mark.usefixtures("poison")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bias_gelu(shape, offset, dtype, tol):
    from fused_kernels.cuda import bias_gelu

    torch.manual_seed(0)
    n = shape[-1]
    flat = (torch.randn(offset + torch.Size(shape).numel(), device="cuda") * 2).to(dtype)
    x = flat[offset:].view(shape).requires_grad_()  # offset 1: data pointer not 16-byte aligned
    b = torch.randn(n, device="cuda").to(dtype).requires_grad_()
    y = bias_gelu(x, b)
    xr, br = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    yr = torch.nn.functional.gelu(xr + br, approximate="tanh")
    assert y.dtype == dtype
    assert_close(y, yr, tol, "y")
    g = torch.randn(shape, dtype=torch.float64, device="cuda")
    dx, db = torch.autograd.grad((y.double() * g).sum(), [x, b])
    dxr, dbr = torch.autograd.grad((yr * g).sum(), [xr, br])
    assert_close(dx, dxr, tol, "dx")
    assert_close(db, dbr, tol * 10, "db")


@pytest.mark.parametrize("dtype,tol", DTYPE_TOLS[:2])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backend_linear(dtype, tol):
    ops = get_ops("cuda")
    assert ops.name == "cuda" and ops.add_layernorm is reference.add_layernorm
    torch.manual_seed(0)
    x = torch.randn(8, 100, 1280, device="cuda", dtype=dtype)
    w = torch.randn(5120, 1280, device="cuda", dtype=dtype) / 1280**0.5
    b = torch.randn(5120, device="cuda", dtype=dtype)
    want = reference.linear(x.double(), w.double(), b.double(), gelu=True)
    assert_close(ops.linear(x, w, b, True), want, tol, "linear+gelu")
    assert_close(ops.linear(x, w, b, False), reference.linear(x.double(), w.double(), b.double(), False), tol, "linear")
