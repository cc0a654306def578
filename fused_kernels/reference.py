"""The `none` backend: the operations the model delegates, written in plain PyTorch.

Every fused backend must compute the same functions (see `fused_kernels.KernelOps`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """y = x @ weight.T + bias, then GPT-2's tanh GELU when `gelu`."""
    y = F.linear(x, weight, bias)
    return F.gelu(y, approximate="tanh") if gelu else y


def add_layernorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual (or x alone); returns (LayerNorm(r), r)."""
    r = x if residual is None else x + residual
    # in the residual stream's dtype, whatever the parameters' (FSDP2's bf16 gather: fp32 r, bf16 weight): what CUDA
    # autocast does for layer_norm, made explicit for the devices whose autocast does not (CPU)
    return F.layer_norm(r, (r.shape[-1],), weight.to(r.dtype), bias.to(r.dtype), eps), r


def lm_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token loss and the count of correct top-1 predictions.

    hidden [N, d], weight [V_padded, d], targets [N] (-100 ignored). Logits of the padded
    vocabulary rows (index >= vocab_size) are excluded, so padding never changes the loss.
    """
    logits = F.linear(hidden, weight)[:, :vocab_size]  # [N, V]
    loss = F.cross_entropy(logits.float(), targets, ignore_index=-100)
    correct = (logits.argmax(dim=-1) == targets).sum()
    return loss, correct
