"""Attention backends for `--attn`: PyTorch SDPA (picks flash/cuDNN/efficient itself) or flash-attn."""

from __future__ import annotations

import torch

from fused_kernels import KernelUnavailableError
from gpt2.model import AttentionFn, sdpa_attention


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal flash-attn. q, k, v: [B, H, T, hd] -> [B, H, T, hd] (flash-attn wants [B, T, H, hd])."""
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, causal=True)
    return out.transpose(1, 2)


def get_attention(name: str) -> AttentionFn:
    if name == "sdpa":
        return sdpa_attention
    if name == "flash":
        try:
            import flash_attn  # noqa: F401
        except ImportError as err:
            raise KernelUnavailableError(
                "--attn flash needs the flash-attn package (`pip install flash-attn --no-build-isolation`, "
                "CUDA only); use --attn sdpa, which already picks PyTorch's flash kernel where it can") from err
        return flash_attention
    raise KernelUnavailableError(f"unknown attention backend {name!r}; choose sdpa or flash")
