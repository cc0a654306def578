"""Shared helpers for the fused-kernel tests: device choice, GPU marks, NaN poisoning, tolerances."""

from __future__ import annotations

import pytest
import torch

# Triton kernels run compiled on a GPU, or in the CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (dtype, tol): max |actual - expected| <= tol * (1 + max |expected|), against an fp64 reference
DTYPE_TOLS = [
    pytest.param(torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, id="bf16"),
    pytest.param(torch.float16, 4e-3, id="fp16"),
]


@pytest.fixture
def poison(monkeypatch):
    """Every torch.empty / empty_like made during the test starts as NaN (floats) or a huge value (ints),
    so an output element a kernel forgets to write fails the comparison instead of passing by luck."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(torch.iinfo(t.dtype).max // 2) if t.dtype != torch.bool else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Fails on any NaN/inf in `actual`, on a shape mismatch, or on an error above tol * (1 + max|expected|)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    a, e = actual.double(), expected.double()
    err = (a - e).abs().max().item()
    bound = tol * (1.0 + e.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"
