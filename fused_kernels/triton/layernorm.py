"""Residual add + LayerNorm, forward and backward, as an autograd Function.

Forward, one program per row (N <= BLOCK_N, the whole row in registers):
    r = x + residual (rounded to r's dtype, as the unfused add would be),  mu = mean(r),
    rstd = 1 / sqrt(var(r) + eps),  xhat = (r - mu) rstd,  y = xhat w + b
It stores y, r and the per-row mu, rstd (fp32); backward needs only r, mu, rstd, w (not y or xhat).

Backward, one program per group of ROWS rows, with g = dy w:
    dr = rstd (g - mean(g) - xhat mean(g xhat)) + dr_out      (dr_out: the gradient arriving at r)
    dx = dresidual = dr
    dw = sum_rows dy xhat,  db = sum_rows dy: each program writes an fp32 partial sum over its rows,
    and one torch reduction over the [n_programs, N] partials finishes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kernels.triton.runtime import is_interpreted


@triton.jit
def add_layernorm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, r_ptr, mean_ptr, rstd_ptr, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    r = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = r.to(tl.float32) + tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        r = r.to(r_ptr.dtype.element_ty)
        tl.store(r_ptr + row * N + cols, r, mask=mask)
    r = r.to(tl.float32)
    mean = tl.sum(r, axis=0) / N
    diff = tl.where(mask, r - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (diff * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def add_layernorm_bwd_kernel(
    dy_ptr, drout_ptr, r_ptr, w_ptr, mean_ptr, rstd_ptr, dr_ptr, dw_part_ptr, db_part_ptr, M, N,
    HAS_DROUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i
        if row < M:
            r = tl.load(r_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (r - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row), 0.0)
            g = dy * w
            c_xhat = tl.sum(g * xhat, axis=0) / N
            c_one = tl.sum(g, axis=0) / N
            dr = (g - xhat * c_xhat - c_one) * tl.load(rstd_ptr + row)
            if HAS_DROUT:
                dr += tl.load(drout_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dr_ptr + row * N + cols, dr.to(dr_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=mask)
    tl.store(db_part_ptr + pid * N + cols, db, mask=mask)


def _bwd_rows(M: int, interpreted: bool) -> int:
    """Rows per backward program: enough programs to fill the GPU, few partial rows to reduce."""
    if interpreted:
        return 8
    n_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return max(1, triton.cdiv(M, 4 * n_sm))


class AddLayerNorm(torch.autograd.Function):
    """(x [M, N], residual [M, N] or None, w [N], b [N]) -> (y, r) with r = x + residual, or y alone without
    a residual; y in out_dtype."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps: float, out_dtype: torch.dtype):
        M, N = x.shape
        block_n = triton.next_power_of_2(N)
        has_res = residual is not None
        r_dtype = torch.result_type(x, residual) if has_res else x.dtype
        r = torch.empty(M, N, dtype=r_dtype, device=x.device) if has_res else x
        y = torch.empty(M, N, dtype=out_dtype, device=x.device)
        mean = torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        num_warps = min(max(block_n // 256, 1), 16)
        add_layernorm_fwd_kernel[(M,)](
            x, residual, weight, bias, y, r, mean, rstd, N, eps,
            HAS_RESIDUAL=has_res, BLOCK_N=block_n, num_warps=num_warps)
        ctx.save_for_backward(r, weight, mean, rstd)
        ctx.has_res = has_res
        ctx.x_dtype = x.dtype
        ctx.res_dtype = residual.dtype if has_res else None
        ctx.num_warps = num_warps
        return (y, r) if has_res else y  # without a residual, r is x itself: the caller returns x

    @staticmethod
    def backward(ctx, dy, *maybe_dr_out):
        r, weight, mean, rstd = ctx.saved_tensors
        dr_out = maybe_dr_out[0] if maybe_dr_out else None
        M, N = r.shape
        dy = dy.contiguous()
        has_drout = ctx.has_res and dr_out is not None
        if has_drout:
            dr_out = dr_out.contiguous()
        rows = _bwd_rows(M, is_interpreted(add_layernorm_bwd_kernel))
        n_prog = triton.cdiv(M, rows)
        dr = torch.empty(M, N, dtype=r.dtype, device=r.device)
        dw_part = torch.empty(n_prog, N, dtype=torch.float32, device=r.device)
        db_part = torch.empty(n_prog, N, dtype=torch.float32, device=r.device)
        add_layernorm_bwd_kernel[(n_prog,)](
            dy, dr_out if has_drout else None, r, weight, mean, rstd, dr, dw_part, db_part, M, N,
            HAS_DROUT=has_drout, ROWS=rows, BLOCK_N=triton.next_power_of_2(N), num_warps=ctx.num_warps)
        dw = dw_part.sum(0).to(weight.dtype)  # [N]
        db = db_part.sum(0).to(weight.dtype)  # [N]
        dx = dr.to(ctx.x_dtype)
        dres = dr.to(ctx.res_dtype) if ctx.has_res else None
        return dx, dres, dw, db, None, None


def add_layernorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `fused_kernels.reference.add_layernorm`: returns (LN(x + residual), x + residual).

    Under autocast the normalised output is fp32, as autocast runs F.layer_norm in fp32.
    """
    shape = x.shape
    N = shape[-1]
    if torch.is_autocast_enabled(x.device.type):
        out_dtype = torch.float32
    else:
        out_dtype = torch.result_type(x, residual) if residual is not None else x.dtype
    x2 = x.reshape(-1, N).contiguous()  # [M, N]
    if residual is None:
        y = AddLayerNorm.apply(x2, None, weight, bias, eps, out_dtype)
        return y.view(shape), x
    res2 = residual.reshape(-1, N).contiguous()  # [M, N]
    y, r = AddLayerNorm.apply(x2, res2, weight, bias, eps, out_dtype)
    return y.view(shape), r.view(shape)
