"""Fused bias + GELU (tanh form), forward and backward, as an autograd Function.

Forward saves only the pre-bias input x (and b); backward recomputes gelu'(x + b) in registers:
    dx = dy * gelu'(x + b),   db = sum_rows dx   (fp32 accumulation)
"""

from __future__ import annotations

import torch
import triton

from fused_kernels.triton.gelu import bias_gelu_bwd_kernel, bias_gelu_fwd_kernel
from fused_kernels.triton.runtime import is_interpreted

TILE = 4096  # elements per program on a GPU: 16 per thread with 8 warps
INTERPRET_TILE = 1 << 14  # the CPU interpreter pays per program and per op, not per element


def _launch(kernel, N: int, M: int, *args, has_bias: bool) -> None:
    tile = INTERPRET_TILE if is_interpreted(kernel) else TILE
    block_n = min(triton.next_power_of_2(N), 1024)
    block_m = max(1, tile // block_n)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    kernel[grid](*args, M, N, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias); x [..., N] contiguous, bias [N] or None."""
    x = x.contiguous()
    y = torch.empty_like(x)
    N = x.shape[-1]
    _launch(bias_gelu_fwd_kernel, N, x.numel() // N, x, bias, y, has_bias=bias is not None)
    return y


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dy * gelu'(x + bias), in x's dtype."""
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    N = x.shape[-1]
    _launch(bias_gelu_bwd_kernel, N, x.numel() // N, dy, x, bias, dx, has_bias=bias is not None)
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
