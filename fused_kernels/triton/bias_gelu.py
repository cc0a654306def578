"""Fused bias + GELU (tanh form), forward and backward, as an autograd Function.

Forward saves only the pre-bias input x (and b); backward recomputes gelu'(x + b) in registers:
    dx = dy * gelu'(x + b),   db = sum_rows dx   (fp32 accumulation)
"""

from __future__ import annotations

import torch
import triton

from fused_kernels.triton.gelu import bias_gelu_bwd_kernel, bias_gelu_fwd_kernel
from fused_kernels.triton.runtime import is_interpreted

BLOCK = 1024
INTERPRET_BLOCK = 4096  # the CPU interpreter pays per op and per program, not per element


def _block() -> int:
    return INTERPRET_BLOCK if is_interpreted(bias_gelu_fwd_kernel) else BLOCK


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias); x [..., N] contiguous, bias [N] or None."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n, N = x.numel(), x.shape[-1]
    block = _block()
    bias_gelu_fwd_kernel[(triton.cdiv(n, block),)](x, bias, y, n, N, HAS_BIAS=bias is not None, BLOCK=block)
    return y


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dy * gelu'(x + bias), in x's dtype."""
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    n, N = x.numel(), x.shape[-1]
    block = _block()
    bias_gelu_bwd_kernel[(triton.cdiv(n, block),)](dy, x, bias, dx, n, N, HAS_BIAS=bias is not None, BLOCK=block)
    return dx


class BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, bias)
        return bias_gelu_forward(x, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, bias = ctx.saved_tensors
        dx = bias_gelu_backward(dy, x, bias)  # [..., N]
        db = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)  # [N]
        return dx, db


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU_tanh(x + bias) with the Triton kernels; bias is cast to x's dtype like a fused epilogue would."""
    return BiasGelu.apply(x, bias.to(x.dtype))
