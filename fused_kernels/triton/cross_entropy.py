"""LM-head cross-entropy without materialising the [N, V] logits: chunked over rows, Liger-style, as the
custom op `gpt2_fused::triton_lm_cross_entropy` (opaque to Inductor: see the comment above it).

For each chunk of rows (all in the input/autocast dtype except the softmax statistics):
    logits = h_c W^T                                   [C, Vp]   (cuBLAS)
    lse = logsumexp(logits[:, :V]),  loss_i = lse - logits[i, t_i]        (Triton, fp32)
    dlogits = (softmax(logits) - onehot(t)) / n_valid, written over logits in place; 0 for padded
              columns (>= V) and for ignored rows (t = -100)
    grad_h[c] = dlogits W,   grad_W += dlogits^T h_c  (fp32 accumulator)
The gradients are computed during forward (the loss is the last op of the graph) and only scaled by
the incoming gradient in backward, so peak memory is one [C, Vp] chunk plus grad_W, not [N, V] fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fused_kernels import lm_head_chunk_rows
from fused_kernels.custom_ops import kernel_op

IGNORE_INDEX = -100  # for the host code; the kernel reads the constexpr below
IGNORE = tl.constexpr(IGNORE_INDEX)  # compiled kernels may only read constexpr globals (the interpreter reads any)
INTERPRETING = triton.knobs.runtime.interpret  # read when the kernel below is decorated


@triton.jit
def ce_chunk_kernel(
    logits_ptr, targets_ptr, inv_n_ptr, loss_ptr, correct_ptr, stride_row,
    V: tl.constexpr, V_PADDED: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row per program. V/V_PADDED are constexpr: fixed per model, and the interpreter (numpy >= 2)
    cannot use runtime scalars as range bounds."""
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    valid = target != IGNORE

    # pass 1: online max / sum-exp and first-occurrence argmax over the real vocabulary
    m = -float("inf")
    s = 0.0
    best = -float("inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        block_arg = tl.argmax(x, axis=0)
        best_idx = tl.where(block_max > best, start + block_arg, best_idx)
        best = tl.maximum(best, block_max)
        m_new = tl.maximum(m, block_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    safe_target = tl.where(valid, target, 0)
    target_logit = tl.load(ptr + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
    tl.store(correct_ptr + row, (best_idx == target).to(tl.int32))

    # pass 2: dlogits = (softmax - onehot) / n_valid over the real vocabulary, 0 on padding / ignored rows
    if COMPUTE_GRAD:
        scale = tl.where(valid, tl.load(inv_n_ptr), 0.0)
        for start in range(0, V_PADDED, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            tl.store(ptr + cols, (g * scale).to(logits_ptr.dtype.element_ty), mask=cols < V_PADDED)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b. On CUDA with 16-bit a and b, cuBLAS adds the product into the fp32 accumulator in its
    epilogue (`addmm(out_dtype=float32)`): no 16-bit product is written, read back and rounded on the way."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # the fp32 path, and CPU, where the out_dtype overload has no kernel
        acc += a @ b


def _forward_fake(hidden, weight, targets, vocab_size, compute_dtype, need_grad, chunk_rows):
    loss, correct = hidden.new_empty((), dtype=torch.float32), hidden.new_empty((), dtype=torch.int64)
    if not need_grad:
        return loss, correct, hidden.new_empty(0), hidden.new_empty(0)
    grad_h = hidden.new_empty(hidden.shape, dtype=compute_dtype)
    return loss, correct, grad_h, weight.new_empty(weight.shape, dtype=torch.float32)


# Opaque (custom_op), not a triton_op that Inductor would trace into, because:
# - the body is a host loop that writes cuBLAS results into slices of its outputs and overwrites each [C, Vp]
#   logits chunk with its gradient in place; traced, these become functional copies that Inductor re-plans,
#   losing the one-chunk peak-memory bound that is this op's point;
# - Dynamo tracing into these launches crashed on a GPU (an illegal memory access in an Inductor kernel next
#   to the chunks); opaque, the op runs exactly the eager code that passed there;
# - there is nothing to fuse: the work is cuBLAS GEMMs either way, and the op's outputs are scalars and gradients.
@kernel_op("triton_lm_cross_entropy", fake=_forward_fake, traced=False)
def lm_cross_entropy_forward(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, compute_dtype: torch.dtype,
    need_grad: bool, chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [N, d], weight [Vp, d], targets [N]) -> (mean loss, n_correct, d loss/d hidden in compute_dtype,
    d loss/d weight in fp32); the gradients are empty [0] tensors unless `need_grad`."""
    N = hidden.shape[0]
    v_padded = weight.shape[0]
    h = hidden.to(compute_dtype)  # [N, d]
    w = weight.to(compute_dtype)  # [Vp, d]
    inv_n = 1.0 / (targets != IGNORE_INDEX).sum().to(torch.float32)  # [] on device: no host sync
    loss_rows = torch.empty(N, dtype=torch.float32, device=h.device)
    correct_rows = torch.empty(N, dtype=torch.int32, device=h.device)
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_grad else hidden.new_empty(0)  # [N, d]
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need_grad else hidden.new_empty(0)
    # the interpreter pays per op, not per element: one block spanning the row is fastest there
    block_v = min(triton.next_power_of_2(v_padded), 8192) if INTERPRETING else 4096
    for s in range(0, N, chunk_rows):
        e = min(s + chunk_rows, N)
        logits = h[s:e] @ w.t()  # [C, Vp]
        ce_chunk_kernel[(e - s,)](
            logits, targets[s:e], inv_n, loss_rows[s:e], correct_rows[s:e], logits.stride(0),
            V=vocab_size, V_PADDED=v_padded, COMPUTE_GRAD=need_grad, BLOCK_V=block_v, num_warps=8)
        if need_grad:  # logits now holds dlogits
            torch.mm(logits, w, out=grad_h[s:e])  # [C, d]
            _accumulate(grad_w, logits.t(), h[s:e])  # [Vp, d] += [Vp, C] @ [C, d]
        del logits  # freed before the next chunk's matmul allocates: one chunk alive at a time, not two
    return loss_rows.sum() * inv_n, correct_rows.sum(dtype=torch.int64), grad_h, grad_w


def _setup_context(ctx, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight = inputs[:2]
    _, correct, grad_h, grad_w = output
    ctx.mark_non_differentiable(correct, grad_h, grad_w)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad_h, grad_w)
    ctx.dtypes = (hidden.dtype, weight.dtype)


def _backward(ctx, dloss: torch.Tensor, *_: None):
    grad_h, grad_w = ctx.saved_tensors
    h_dtype, w_dtype = ctx.dtypes
    return (grad_h * dloss).to(h_dtype), (grad_w * dloss).to(w_dtype), None, None, None, None, None


lm_cross_entropy_forward.register_autograd(_backward, setup_context=_setup_context)


def lm_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `fused_kernels.reference.lm_cross_entropy`: (mean loss, n_correct).

    hidden [N, d], weight [Vp, d], targets [N] (-100 ignored); logits columns >= vocab_size excluded.
    Logits are computed in the autocast dtype when autocast is on (as F.linear would), else in hidden's.
    """
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    rows = chunk_rows or lm_head_chunk_rows(hidden.shape[0], weight.shape[0])
    with torch.autocast(device_type, enabled=False):  # the op's matmuls run in compute_dtype
        loss, correct, _, _ = lm_cross_entropy_forward(
            hidden, weight, targets.contiguous(), vocab_size, compute_dtype, need_grad, rows)
    return loss, correct
