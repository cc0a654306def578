"""Fused bias + GELU (tanh form), forward and backward, as the custom ops `gpt2_fused::triton_bias_gelu` and
`gpt2_fused::triton_bias_gelu_backward` (registered by `fused_kernels.custom_ops.bias_gelu_ops`).

Forward saves only the pre-bias input x (and b); backward recomputes gelu'(x + b) in registers:
    dx = dy * gelu'(x + b),   db = sum_rows dx   (fp32 accumulation)
"""

from __future__ import annotations

import torch
import triton

from fused_kernels.custom_ops import bias_gelu_ops, opaque_requested
from fused_kernels.triton.gelu import bias_gelu_bwd_kernel, bias_gelu_fwd_kernel
from fused_kernels.triton.runtime import is_interpreted, wrap_triton

TILE = 4096  # elements per program on a GPU: 16 per thread with 8 warps
INTERPRET_TILE = 1 << 14  # the CPU interpreter pays per program and per op, not per element
INTERPRETED = is_interpreted(bias_gelu_fwd_kernel)


def _tiles(N: int, M: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_M, BLOCK_N) for an [M, N] elementwise pass."""
    block_n = min(triton.next_power_of_2(N), 1024)
    block_m = max(1, (INTERPRET_TILE if INTERPRETED else TILE) // block_n)
    return (triton.cdiv(M, block_m), triton.cdiv(N, block_n)), block_m, block_n


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias); x [..., N], bias [N] or None."""
    x = x.contiguous()
    y = torch.empty_like(x)
    N = x.shape[-1]
    M = x.numel() // N
    grid, block_m, block_n = _tiles(N, M)
    wrap_triton(bias_gelu_fwd_kernel)[grid](
        x, bias, y, M, N, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
    return y


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """dy * gelu'(x + bias), in x's dtype; x contiguous."""
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    N = x.shape[-1]
    M = x.numel() // N
    grid, block_m, block_n = _tiles(N, M)
    wrap_triton(bias_gelu_bwd_kernel)[grid](
        dy, x, bias, dx, M, N, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8)
    return dx


bias_gelu_op, bias_gelu_backward_op = bias_gelu_ops(
    "triton", bias_gelu_forward, bias_gelu_backward, traced=not INTERPRETED and not opaque_requested())


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU_tanh(x + bias) with the Triton kernels; bias is cast to x's dtype like a fused epilogue would."""
    return bias_gelu_op(x.contiguous(), bias.to(x.dtype))
