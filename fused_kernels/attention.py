"""Attention functions for `--attn sdpa|flash`, with the `gpt2.model.AttentionFn` signature:
(q, k, v [B, H, T, hd], dropout_p) -> [B, H, T, hd], causal.

`sdpa` lets PyTorch choose among its flash / cuDNN / memory-efficient / math kernels;
`sdpa_backend_used` finds out which one it chose, for the run summary. `flash` calls the flash-attn
package (Dao et al.) directly and is a clear error when that package is not installed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fused_kernels import KernelUnavailableError

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal SDPA; PyTorch picks the kernel. q, k, v: [B, H, T, hd] -> [B, H, T, hd]."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def _flash_attn_func() -> Callable[..., torch.Tensor]:
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        raise KernelUnavailableError(
            "--attn flash needs the flash-attn package (pip install flash-attn --no-build-isolation, on a CUDA "
            f"machine); use --attn sdpa, which can pick PyTorch's own flash kernel ({e})") from e
    return flash_attn_func


def make_flash_attention() -> AttentionFn:
    """flash_attn_func wrapped to the [B, H, T, hd] layout; raises KernelUnavailableError without flash-attn."""
    flash_attn_func = _flash_attn_func()

    def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        # flash-attn takes [B, T, H, hd] and fp16/bf16 CUDA tensors
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, T, H, hd]
        out = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)  # [B, T, H, hd]
        return out.transpose(1, 2)  # [B, H, T, hd]

    return flash_attention


def get_attention(name: str) -> AttentionFn:
    """The attention function for `--attn name` ("sdpa" or "flash")."""
    if name == "sdpa":
        return sdpa_attention
    if name == "flash":
        return make_flash_attention()
    raise KernelUnavailableError(f"unknown attention {name!r}; choose sdpa or flash")


def sdpa_backend_used(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | str, dropout_p: float = 0.0,
    requires_grad: bool = True,
) -> str:
    """Which SDPA kernel PyTorch runs for causal attention on [B, H, T, hd] inputs of this dtype/device.

    PyTorch takes the first enabled backend, in its priority order, whose constraints the inputs meet;
    this probes the same order by allowing one backend at a time on a [1, 1, T, hd] input (the choice
    does not depend on batch or heads). Returns e.g. "FLASH_ATTENTION", "CUDNN_ATTENTION",
    "EFFICIENT_ATTENTION" or "MATH".
    """
    _, _, T, hd = shape
    q = torch.randn(1, 1, T, hd, dtype=dtype, device=device, requires_grad=requires_grad)
    for backend in (SDPBackend(i) for i in torch._C._get_sdp_priority_order()):
        if backend in (SDPBackend.OVERRIDEABLE, SDPBackend.ERROR):
            continue
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")  # each refusing backend warns why
                F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True)
        except RuntimeError:
            continue
        return backend.name
    raise RuntimeError(f"no SDPA backend accepts shape {shape}, {dtype} on {device}")
