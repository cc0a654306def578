"""y = GELU_tanh(x @ W^T + b) in one tiled Triton kernel (the MLP up-projection), as the custom op
`gpt2_fused::triton_matmul_bias_gelu` with its backward registered (`fused_kernels.custom_ops`).

Forward: a grouped-order tiled matmul that accumulates in fp32 and applies bias + GELU in the
epilogue, so the pre-activation never makes a round trip through memory before the GELU. When a
gradient is needed the epilogue also stores pre = x W^T + b (in x's dtype), which backward needs:
    dpre = dy * gelu'(pre)        (one elementwise Triton kernel: the op triton_bias_gelu_backward)
    dx = dpre @ W,  dW = dpre^T @ x,  db = sum_rows dpre     (cuBLAS / torch)
Saving pre costs one extra store of [M, N]; recomputing it would cost a third more backward FLOPs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kernels.custom_ops import kernel_op, opaque_requested
from fused_kernels.triton.bias_gelu import bias_gelu_backward_op
from fused_kernels.triton.gelu import gelu_fwd
from fused_kernels.triton.runtime import wrap_triton

INTERPRETING = triton.knobs.runtime.interpret  # read when the kernels below are decorated


def _configs() -> list[triton.Config]:
    """Autotune space (Hopper-friendly tiles); a single small config under the interpreter so CPU tests stay fast."""
    if INTERPRETING:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4, num_stages=1)]
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
        (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
    ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for m, n, k, w, s in shapes
    ]


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop tiles much larger than the problem (they only waste compile time on small shapes)."""
    M, N = named_args["M"], named_args["N"]
    fits = [c for c in configs
            if c.kwargs["BLOCK_M"] <= max(64, triton.next_power_of_2(M))
            and c.kwargs["BLOCK_N"] <= max(64, triton.next_power_of_2(N))]
    return fits or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


# K is a constexpr: the K loop's trip count is then known to the compiler, and Triton's interpreter
# (numpy >= 2) cannot use a runtime scalar as a Python range bound.
@triton.autotune(configs=_configs(), key=["M", "N", "K", "STORE_PRE"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit
def matmul_bias_gelu_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, pre_ptr, M, N, K: tl.constexpr,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, STORE_PRE: tl.constexpr, FP32_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped ordering: GROUP_M row-tiles share each column tile, so W tiles stay in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :].to(tl.int64) * stride_wn  # [BK, BN] = W^T tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_left = K - k
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=FP32_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if STORE_PRE:
        tl.store(pre_ptr + out_offs, acc.to(pre_ptr.dtype.element_ty), mask=out_mask)
    tl.store(y_ptr + out_offs, gelu_fwd(acc).to(y_ptr.dtype.element_ty), mask=out_mask)


def _outputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             store_pre: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """matmul_bias_gelu's outputs (y, pre), uninitialised: its allocation, and its fake."""
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return y, torch.empty_like(y) if store_pre else y.new_empty(0)


@kernel_op("triton_matmul_bias_gelu", fake=_outputs, traced=not INTERPRETING and not opaque_requested())
def matmul_bias_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [N, K], bias [N] -> (gelu(x W^T + b) [M, N], pre = x W^T + b [M, N]; pre is an empty [0]
    unless `store_pre`)."""
    M, K = x.shape
    N = weight.shape[0]
    y, pre = _outputs(x, weight, bias, store_pre)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    wrap_triton(matmul_bias_gelu_kernel)[grid](
        x, weight, bias, y, pre if store_pre else None, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, STORE_PRE=store_pre,
        # fp32 inputs: tf32 only where PyTorch's own matmuls would use it; other dtypes ignore this
        FP32_PRECISION="ieee" if x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32",
        DOT_IN_FP32=INTERPRETING)  # Triton 3.6's interpreter gets bf16/fp16 tl.dot wrong; it is exact in fp32
    return y, pre


def _setup_context(ctx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, bias, _ = inputs
    _, pre = output
    ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)  # no zero-filled [M, N] gradient for pre
    ctx.save_for_backward(x, weight, pre)
    ctx.has_bias = bias is not None


def _backward(ctx, dy: torch.Tensor, _dpre: None):
    x, weight, pre = ctx.saved_tensors
    dpre = bias_gelu_backward_op(dy, pre, None)  # [M, N] = dy * gelu'(pre)
    dx = dpre @ weight if ctx.needs_input_grad[0] else None  # [M, K]
    dw = dpre.t() @ x if ctx.needs_input_grad[1] else None  # [N, K]
    db = dpre.sum(0, dtype=torch.float32).to(dpre.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db, None


matmul_bias_gelu.register_autograd(_backward, setup_context=_setup_context)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GELU_tanh(x @ weight.T + bias) for x [..., K]; under autocast, inputs are cast like F.linear's."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    # pre is stored only when backward will need it
    store_pre = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    with torch.autocast(x.device.type, enabled=False):
        y, _ = matmul_bias_gelu(x2, weight, bias, store_pre)  # [M, N]
    return y.view(*lead, weight.shape[0])
