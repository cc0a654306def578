"""Residual add + LayerNorm, forward and backward, as the custom ops `gpt2_fused::triton_add_layernorm` (with
its backward registered) and `gpt2_fused::triton_add_layernorm_backward`.

Forward, one program per tile of BLOCK_M rows (whole rows in registers, N <= BLOCK_N):
    r = x + residual (rounded to r's dtype, as the unfused add would be),  mu = mean(r),
    rstd = 1 / sqrt(var(r) + eps),  xhat = (r - mu) rstd,  y = xhat w + b
It stores y, r and the per-row mu, rstd (fp32); backward needs only r, mu, rstd, w (not y or xhat).

Backward, one program per group of TILES tiles, with g = dy w:
    dr = rstd (g - mean(g) - xhat mean(g xhat)) + dr_out      (dr_out: the gradient arriving at r)
    dx = dresidual = dr
    dw = sum_rows dy xhat,  db = sum_rows dy: each program writes an fp32 partial sum over its rows,
    and one torch reduction over the [n_programs, N] partials finishes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kernels.custom_ops import kernel_op, opaque_requested
from fused_kernels.triton.runtime import is_interpreted, wrap_triton


@triton.jit
def add_layernorm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, r_ptr, mean_ptr, rstd_ptr, M, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]  # [BM, BN]
    offs = rows[:, None] * N + cols[None, :]
    r = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = r.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = r.to(r_ptr.dtype.element_ty)  # round like the unfused add, then normalise the rounded sum
        tl.store(r_ptr + offs, r, mask=mask)
    r = r.to(tl.float32)
    mean = tl.sum(r, axis=1) / N  # [BM]
    diff = tl.where(mask, r - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / N + eps)  # [BM]
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = diff * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rows < M)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)


@triton.jit
def add_layernorm_bwd_kernel(
    dy_ptr, drout_ptr, r_ptr, w_ptr, mean_ptr, rstd_ptr, dr_ptr, dw_part_ptr, db_part_ptr, M, N,
    HAS_DROUT: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Each program handles TILES consecutive [BLOCK_M, N] tiles and writes one partial dw/db row."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in range(TILES):
        rows = (pid.to(tl.int64) * TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * N + cols[None, :]
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (r - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c_xhat = tl.sum(g * xhat, axis=1) / N  # [BM]
        c_one = tl.sum(g, axis=1) / N  # [BM]
        dr = (g - xhat * c_xhat[:, None] - c_one[:, None]) * rstd[:, None]
        if HAS_DROUT:
            dr += tl.load(drout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dr_ptr + offs, dr.to(dr_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=col_ok)
    tl.store(db_part_ptr + pid * N + cols, db, mask=col_ok)


INTERPRETED = is_interpreted(add_layernorm_fwd_kernel)
TRACED = not INTERPRETED and not opaque_requested()


def _tile(N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): whole rows in registers, several short rows per tile. The interpreter
    pays per program and per op rather than per element, so it gets tall tiles."""
    block_n = triton.next_power_of_2(N)
    block_m = max(1, (4096 if INTERPRETED else 2048) // block_n)
    return block_m, block_n, min(max(block_m * block_n // 256, 1), 16)


def _bwd_tiles(M: int, block_m: int, device: torch.device) -> int:
    """Tiles per backward program: enough programs to fill the GPU, few partial rows to reduce."""
    n_tiles = triton.cdiv(M, block_m)
    if INTERPRETED:
        return 2  # few programs, yet more than one partial sum on the test shapes
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, triton.cdiv(n_tiles, 4 * n_sm))


def _forward_outputs(x, residual, weight, bias, eps, out_dtype) -> tuple[torch.Tensor, ...]:
    """add_layernorm_forward's outputs (y, r, mean, rstd), uninitialised: its allocation, and its fake."""
    M, N = x.shape
    if residual is None:
        r = x.new_empty(0)  # r is x itself, which an op cannot return
    else:
        r = torch.empty(M, N, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    return y, r, *(torch.empty(M, dtype=torch.float32, device=x.device) for _ in range(2))


@kernel_op("triton_add_layernorm", fake=_forward_outputs, traced=TRACED)
def add_layernorm_forward(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [M, N], residual [M, N] or None, w [N], b [N]) -> (y in out_dtype, r = x + residual, mean, rstd) for
    contiguous x and residual; without a residual r is an empty [0]."""
    M, N = x.shape
    block_m, block_n, num_warps = _tile(N)
    has_res = residual is not None
    y, r, mean, rstd = _forward_outputs(x, residual, weight, bias, eps, out_dtype)
    wrap_triton(add_layernorm_fwd_kernel)[(triton.cdiv(M, block_m),)](
        x, residual, weight, bias, y, r if has_res else None, mean, rstd, M, N, eps,
        HAS_RESIDUAL=has_res, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y, r, mean, rstd


def _backward_fake(dy, dr_out, r, weight, mean, rstd):
    return torch.empty_like(r), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


@kernel_op("triton_add_layernorm_backward", fake=_backward_fake, traced=TRACED)
def add_layernorm_backward(
    dy: torch.Tensor, dr_out: torch.Tensor | None, r: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dr [M, N] in r's dtype, dw [N], db [N] in w's dtype); dr_out: the gradient arriving at r, or None."""
    M, N = r.shape
    dy = dy.contiguous()
    has_drout = dr_out is not None
    if has_drout:
        dr_out = dr_out.contiguous()
    block_m, block_n, num_warps = _tile(N)
    tiles = _bwd_tiles(M, block_m, r.device)
    n_prog = triton.cdiv(M, block_m * tiles)
    dr = torch.empty(M, N, dtype=r.dtype, device=r.device)
    dw_part = torch.empty(n_prog, N, dtype=torch.float32, device=r.device)
    db_part = torch.empty(n_prog, N, dtype=torch.float32, device=r.device)
    wrap_triton(add_layernorm_bwd_kernel)[(n_prog,)](
        dy, dr_out, r, weight, mean, rstd, dr, dw_part, db_part, M, N,
        HAS_DROUT=has_drout, TILES=tiles, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return dr, dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)


def _setup_context(ctx, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
    x, residual, weight, _, _, _ = inputs
    _, r, mean, rstd = output
    ctx.has_res = residual is not None
    ctx.mark_non_differentiable(mean, rstd, *(() if ctx.has_res else (r,)))
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero-filled [M, N] tensors
    ctx.save_for_backward(r if ctx.has_res else x, weight, mean, rstd)  # backward needs r = x + residual only
    ctx.x_dtype = x.dtype
    ctx.res_dtype = residual.dtype if ctx.has_res else None


def _backward(ctx, dy: torch.Tensor | None, dr_out: torch.Tensor | None, _dmean: None, _drstd: None):
    r, weight, mean, rstd = ctx.saved_tensors
    if dy is None:  # only r is used downstream
        dy = torch.zeros_like(r)
    dr, dw, db = add_layernorm_backward(dy, dr_out if ctx.has_res else None, r, weight, mean, rstd)
    return dr.to(ctx.x_dtype), dr.to(ctx.res_dtype) if ctx.has_res else None, dw, db, None, None


add_layernorm_forward.register_autograd(_backward, setup_context=_setup_context)


def add_layernorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `fused_kernels.reference.add_layernorm`: returns (LN(x + residual), x + residual).

    Under autocast the normalised output is in the autocast dtype, not F.layer_norm's fp32: every LayerNorm of the
    model feeds a matmul, which autocast would cast it to anyway, so the kernel rounds it as that cast would and the
    cast and its backward are not two more passes over [M, N].
    """
    shape = x.shape
    N = shape[-1]
    if torch.is_autocast_enabled(x.device.type):
        out_dtype = torch.get_autocast_dtype(x.device.type)
    else:
        out_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    x2 = x.reshape(-1, N).contiguous()  # [M, N]
    res2 = residual.reshape(-1, N).contiguous() if residual is not None else None  # [M, N]
    y, r, _, _ = add_layernorm_forward(x2, res2, weight, bias, eps, out_dtype)
    return y.view(shape), (x if residual is None else r.view(shape))
