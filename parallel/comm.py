"""Autograd collectives for tensor and sequence parallelism (the communication half of `parallel/`).

Named after the Megatron-LM paper (Shoeybi et al. 2019, Fig. 3) and its sequence-parallel sequel
(Korthikanti et al. 2022). Each is a small `torch.autograd.Function` whose backward is the conjugate
collective; every one takes its `group` as an argument and is the identity when the group has one rank.

    f  copy_to_tp            fwd: identity                        bwd: all-reduce
    g  reduce_from_tp        fwd: all-reduce                      bwd: identity
       gather_from_tp        fwd: all-gather along the last dim   bwd: split along the last dim
       scatter_to_tp         fwd: split along the last dim        bwd: all-gather along the last dim
    g' gather_from_sequence  fwd: all-gather along the sequence   bwd: reduce-scatter along the sequence
    g' reduce_scatter_to_sequence  fwd: reduce-scatter            bwd: all-gather
       scatter_to_sequence   fwd: split along the sequence        bwd: all-gather

Sequence-parallel activations are batch-first shards [B, T/tp, d] (the model is batch-first, so the
sequence is dim 1; rank r holds positions [r T/tp, (r+1) T/tp)). NCCL/gloo gather and scatter along
dim 0, so the sequence collectives go through a [tp*B, T/tp, d] staging copy.

Byte accounting: pass a `CommStats` and every collective adds the size of the full (unsharded) tensor
it operates on (all-reduce: the tensor; all-gather: its output; reduce-scatter: its input) under its
op name and phase ("fwd", "bwd" or "grad"). A ring all-reduce moves about twice the bytes of an
all-gather or reduce-scatter on the wire; these counts are the logical payload, which is what the
analytical per-step formulas in the tests count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None

# torch 2.13 renamed the flat-buffer collectives (the old names warn); torch 2.11 has only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes and calls per (op, phase), e.g. ("all_reduce", "bwd"). Passed in explicitly; never global."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def record(self, op: str, phase: str, tensor: torch.Tensor) -> None:
        self.bytes[(op, phase)] += tensor.numel() * tensor.element_size()
        self.calls[(op, phase)] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def group_size(group: Group) -> int:
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return dist.get_rank(group)


def _fresh_output(written_in_place: torch.Tensor) -> torch.Tensor:
    """A forward's result that a collective wrote in place, returned as a view of itself (no copy).

    torch 2.11's Dynamo gives the backward of an autograd.Function zeros instead of the incoming gradient when
    its forward returns a tensor last written in place, under every backend (pytorch/pytorch#184113; not seen
    on 2.13): TP under --compile then trained another function. A view is an ordinary output to it."""
    return written_in_place.view_as(written_in_place)


def _record(stats: CommStats | None, op: str, phase: str, tensor: torch.Tensor) -> None:
    if stats is not None:
        stats.record(op, phase, tensor)


# ---- plain collectives (no autograd); the Functions below and the layers' overlapped backward use them ----

def all_reduce(x: torch.Tensor, group: Group, stats: CommStats | None, phase: str,
               op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of a contiguous tensor; returns the work handle when `async_op`."""
    _record(stats, "all_reduce", phase, x)
    return dist.all_reduce(x, op=op, group=group, async_op=async_op)


def split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's chunk of the last dim: [..., n] -> [..., n/tp] (contiguous copy)."""
    size = group_size(group)
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


def all_gather_last(x: torch.Tensor, group: Group, stats: CommStats | None, phase: str) -> torch.Tensor:
    """[..., n/tp] on every rank -> [..., n], chunks in rank order."""
    size = group_size(group)
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # rank chunks on dim 0
    _all_gather_flat(out, x.contiguous(), group=group)
    _record(stats, "all_gather", phase, out)
    return torch.cat(out.chunk(size), dim=-1)


def split_sequence(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """This rank's sequence shard: [B, T, d] -> [B, T/tp, d] (contiguous copy)."""
    size, T = group_size(group), x.shape[dim]
    if T % size:
        raise ValueError(f"sequence length {T} is not divisible by the tensor-parallel size {size}; "
                         f"with --sequence-parallel use a --seq-len that is a multiple of --tp-size")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def all_gather_sequence(x: torch.Tensor, group: Group, stats: CommStats | None, phase: str,
                        dim: int = 1, async_op: bool = False):
    """[B, T/tp, d] -> [B, T, d]. With `async_op` returns (staging buffer, handle); finish with `finish_gather`."""
    size = group_size(group)
    staging = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # [tp*B, T/tp, d]
    _record(stats, "all_gather", phase, staging)
    handle = _all_gather_flat(staging, x.contiguous(), group=group, async_op=async_op)
    if async_op:
        return staging, handle
    return finish_gather(staging, size, dim)


def finish_gather(staging: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """[tp*B, T/tp, d] (rank chunks stacked on dim 0) -> [B, T, d] (rank chunks along `dim`)."""
    return torch.cat(staging.chunk(size), dim=dim)


def reduce_scatter_sequence(x: torch.Tensor, group: Group, stats: CommStats | None, phase: str,
                            dim: int = 1, async_op: bool = False):
    """Sum over ranks, keep this rank's shard: [B, T, d] -> [B, T/tp, d]. With `async_op` returns (out, handle)."""
    size, T = group_size(group), x.shape[dim]
    if T % size:
        raise ValueError(f"sequence length {T} is not divisible by the tensor-parallel size {size}; "
                         f"with --sequence-parallel use a --seq-len that is a multiple of --tp-size")
    staging = torch.cat(x.chunk(size, dim=dim))  # [tp*B, T/tp, d]: rank chunks stacked on dim 0
    out = torch.empty((staging.shape[0] // size, *staging.shape[1:]), dtype=x.dtype, device=x.device)
    _record(stats, "reduce_scatter", phase, x)
    handle = _reduce_scatter_flat(out, staging, group=group, async_op=async_op)
    return (out, handle) if async_op else out


# ---- autograd Functions ----

class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward (entry of a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        all_reduce(grad, ctx.group, ctx.stats, "bwd")
        return grad, None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum of the ranks' partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x, group, stats):
        x = x.contiguous().clone()  # all-reduce is in place; never mutate the caller's tensor
        all_reduce(x, group, stats, "fwd")
        return _fresh_output(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's chunk of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group = group
        return all_gather_last(x, group, stats, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return split_last(grad, ctx.group), None, None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's chunk of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last(grad, ctx.group, ctx.stats, "bwd"), None, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather the sequence forward; reduce-scatter the gradient backward (entry of a TP region under SP)."""

    @staticmethod
    def forward(ctx, x, group, stats, dim):
        ctx.group, ctx.stats, ctx.dim = group, stats, dim
        return all_gather_sequence(x, group, stats, "fwd", dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group, ctx.stats, "bwd", ctx.dim), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather the gradient backward (exit of a TP region under SP)."""

    @staticmethod
    def forward(ctx, x, group, stats, dim):
        ctx.group, ctx.stats, ctx.dim = group, stats, dim
        return _fresh_output(reduce_scatter_sequence(x, group, stats, "fwd", dim))

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group, ctx.stats, "bwd", ctx.dim), None, None, None


class _ScatterToSequence(torch.autograd.Function):
    """Keep this rank's sequence shard forward (no communication); all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, stats, dim):
        ctx.group, ctx.stats, ctx.dim = group, stats, dim
        return split_sequence(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group, ctx.stats, "bwd", ctx.dim), None, None, None


def copy_to_tp(x: torch.Tensor, group: Group, stats: CommStats | None = None) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group, stats)


def reduce_from_tp(x: torch.Tensor, group: Group, stats: CommStats | None = None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group, stats)


def gather_from_tp(x: torch.Tensor, group: Group, stats: CommStats | None = None) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group, stats)


def scatter_to_tp(x: torch.Tensor, group: Group, stats: CommStats | None = None) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group, stats)


def gather_from_sequence(x: torch.Tensor, group: Group, stats: CommStats | None = None,
                         dim: int = 1) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group, stats, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group, stats: CommStats | None = None,
                               dim: int = 1) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group, stats, dim)


def scatter_to_sequence(x: torch.Tensor, group: Group, stats: CommStats | None = None,
                        dim: int = 1) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group, stats, dim)
