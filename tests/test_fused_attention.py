"""--attn sdpa|flash: both compute causal attention; flash is a clear error without flash-attn; the SDPA
backend probe names a real kernel."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from fused_kernels import KernelUnavailableError
from fused_kernels.attention import get_attention, sdpa_backend_used

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _causal_attention_fp64(q, k, v):
    """softmax(q k^T / sqrt(hd) + causal mask) v, in fp64. q, k, v: [B, H, T, hd]."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, T, T]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def test_sdpa_is_causal_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16) for _ in range(3))
    torch.testing.assert_close(get_attention("sdpa")(q, k, v, 0.0).double(), _causal_attention_fp64(q, k, v),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash-attn is installed")
def test_flash_without_package_is_a_clear_error():
    with pytest.raises(KernelUnavailableError, match="flash-attn"):
        get_attention("flash")


def test_unknown_attention_is_an_error():
    with pytest.raises(KernelUnavailableError, match="sdpa or flash"):
        get_attention("paged")


def test_sdpa_backend_probe_cpu():
    assert sdpa_backend_used((2, 3, 37, 16), torch.float32, "cpu") in ("FLASH_ATTENTION", "MATH")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sdpa_backend_probe_gpu():
    used = sdpa_backend_used((8, 20, 1024, 64), torch.bfloat16, "cuda")
    assert used in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"), used


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FLASH_ATTN), reason="needs a GPU and flash-attn")
def test_flash_matches_reference():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 129, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = get_attention("flash")(q, k, v, 0.0)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), _causal_attention_fp64(q, k, v), atol=2e-2, rtol=2e-2)
