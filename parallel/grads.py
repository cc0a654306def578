"""Gradient bookkeeping a tensor-parallel model needs between backward and the optimizer step.

1. Sequence parallelism: parameters marked `sequence_parallel` by the TP plan (LayerNorms, row-parallel
   biases) are replicated, yet each TP rank computes only its sequence shard's share of their gradient;
   the sum over the TP group is the full gradient. Use exactly one of:
     - `allreduce_sequence_parallel_grads(model, dims)` after the last backward of a step, before
       clipping: one coalesced all-reduce; for engines that own `.grad` (single process, DDP);
     - `register_sequence_parallel_grad_hooks(model, dims)` once, before wrapping the model: each
       gradient is summed as autograd produces it, before DDP's or DeepSpeed ZeRO-3's accumulation
       hooks see it (ZeRO-3 partitions gradients in backward, so they cannot be reduced afterwards).
   Gradients are linear, so either commutes with data-parallel averaging and gradient accumulation.
2. Clipping: each TP rank holds a different shard of the sharded weights, so the global norm sums
   their squares over the TP group and counts the replicated parameters once (`clip_grad_norm_`).
   DeepSpeed does the same itself from the `tensor_model_parallel` marks and the mpu.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from parallel import comm
from parallel.comm import CommStats
from parallel.dims import ParallelDims


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters the plan marked: replicated, but each TP rank holds only its sequence shard's gradient."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(model: nn.Module, dims: ParallelDims, stats: CommStats | None = None) -> None:
    """Sum the marked parameters' gradients over the TP group, in one coalesced all-reduce."""
    # a DTensor gradient (FSDP2): this rank's shard; TP peers hold the same shard of a replicated parameter
    grads = [local_shard(p.grad) for p in sequence_parallel_params(model) if p.grad is not None]
    if not grads or dims.tp_size == 1:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    comm.all_reduce(flat, dims.tp_group, stats, "grad")
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def register_sequence_parallel_grad_hooks(model: nn.Module, dims: ParallelDims,
                                          stats: CommStats | None = None) -> list:
    """Sum each marked gradient over the TP group as backward produces it. Returns the hook handles."""
    if dims.tp_size == 1:
        return []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, dims.tp_group, stats, "grad")
        return grad

    return [p.register_hook(hook) for p in sequence_parallel_params(model)]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage `to_local` views, without its dispatch or autograd: a call per tensor
    and step); any other tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all elements, fp32, with multi-tensor (foreach) kernels rather than two per tensor."""
    if not grads:
        return torch.zeros((), device=device, dtype=torch.float32)
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0).float().square()


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (L2) for a TP model, and for FSDP2's DTensor gradients: `grad_norm`, then
    every local gradient multiplied by min(1, max_norm / (norm + 1e-6)). Returns the (pre-clip) total norm."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, dims)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grads_with_norm_, on the local grads
    if params:
        torch._foreach_mul_([local_shard(p.grad) for p in params], clip_coef)
    return total


def grad_norm(parameters: Iterable[nn.Parameter], dims: ParallelDims) -> torch.Tensor:
    """The global L2 gradient norm of a TP model, and of FSDP2's DTensor gradients: the norm of the full, unsharded
    gradient (what `clip_grad_norm_` returns; nothing is clipped).

    ||g||^2 = sum over the ranks that split a gradient of their shards' squares: the TP-sharded parameters' over the
    TP group, the replicated ones' once (TP rank 0), and, for DTensor gradients (FSDP2's, Shard(0) over the
    data-parallel group), over the DP group too. Each rank sums its local tensors and one all-reduce adds the ranks
    up: DTensor's own norm would give the same number, but dispatches every op on every gradient (pytorch/pytorch
    #134191: host time that grows with the parameter count), and so would torch's clip on DTensors.
    Call after the sequence-parallel reduction (replicated gradients must already agree across ranks).
    Returns the total norm, the same on every rank.
    """
    grads = [(p.grad, getattr(p, "tensor_model_parallel", False)) for p in parameters if p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    dp_sharded = any(isinstance(g, DTensor) for g, _ in grads)
    sharded = [local_shard(g) for g, tp in grads if tp]
    replicated = [local_shard(g) for g, tp in grads if not tp]
    total_sq = _sum_of_squares(sharded, device)
    if dims.tp_rank == 0:
        total_sq = total_sq + _sum_of_squares(replicated, device)
    if dp_sharded:  # DP x TP ranks are the world: one all-reduce over both (the default group)
        dist.all_reduce(total_sq)
    elif dims.tp_size > 1:
        dist.all_reduce(total_sq, group=dims.tp_group)
    return total_sq.sqrt()
