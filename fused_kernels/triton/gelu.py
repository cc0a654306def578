"""GPT-2's tanh GELU and its derivative as Triton device functions, plus the elementwise kernels.

    gelu(x)  = 0.5 x (1 + tanh(u)),  u = k (x + c x^3),  k = sqrt(2/pi), c = 0.044715
             = x * s,                s = sigmoid(2u)      (since 0.5 (1 + tanh(u)) = sigmoid(2u))
    gelu'(x) = s + x s (1 - s) * 2k (1 + 3 c x^2)
The sigmoid form avoids tanh, which Triton's core language (and its interpreter) lacks.
"""

from __future__ import annotations

import triton
import triton.language as tl

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_C = tl.constexpr(0.044715)


@triton.jit
def gelu_fwd(x):
    """x: fp32 block -> gelu(x), fp32."""
    u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@triton.jit
def gelu_grad(x):
    """x: fp32 block -> d gelu / dx, fp32."""
    u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x)
    s = tl.sigmoid(2.0 * u)
    return s + x * s * (1.0 - s) * (2.0 * SQRT_2_OVER_PI) * (1.0 + 3.0 * GELU_C * x * x)


@triton.jit
def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile of a contiguous [M, N] tensor: (offsets, mask, column indices); a 2D
    grid avoids a per-element `offset % N`. Index math only: torch.compile's mutation analysis of user kernels
    counts every pointer passed into a helper whose result addresses a store as written (and would copy it)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows[:, None] * N + cols[None, :], mask, cols


@triton.jit
def pre_activation(x_ptr, b_ptr, offs, mask, cols, N, HAS_BIAS: tl.constexpr):
    """x (+ b) over a tile, in fp32; b is loaded once per tile."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return x


@triton.jit
def bias_gelu_fwd_kernel(x_ptr, b_ptr, y_ptr, M, N, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """y = gelu(x + b) over a contiguous [M, N] tensor, one [BLOCK_M, BLOCK_N] tile per program."""
    offs, mask, cols = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    x = pre_activation(x_ptr, b_ptr, offs, mask, cols, N, HAS_BIAS)
    tl.store(y_ptr + offs, gelu_fwd(x).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_bwd_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, M, N, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """dx = dy * gelu'(x + b): the gradient w.r.t. the pre-activation (and, summed over rows, w.r.t. b)."""
    offs, mask, cols = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    x = pre_activation(x_ptr, b_ptr, offs, mask, cols, N, HAS_BIAS)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (dy * gelu_grad(x)).to(dx_ptr.dtype.element_ty), mask=mask)
