"""Tensor-parallel layers (the logic half of `parallel/`; the collectives live in `parallel.comm`).

Each layer presents the forward signature of the GPT-2 module it replaces (`gpt2.model.gpt`), so the model's
forward runs unchanged:

    ColumnParallelLinear.forward(x, gelu=False)   Linear: output features split; x replicated (or a sequence shard)
    RowParallelLinear.forward(x, gelu=False)      Linear: input features split; output summed over ranks
    VocabParallelEmbedding.forward(idx)           Embedding: vocabulary rows split
    SequenceShardedEmbedding.forward(pos)         Embedding (positions) under sequence parallelism
    VocabParallelLMHead.forward(hidden, targets)  LMHead: tied to the vocab-parallel embedding's shard

Layers receive their already-sharded parameters (`parallel.tp_plan` cuts them from the full model) and
their group explicitly. With `sequence_parallel`, activations outside the TP regions are [B, T/tp, d]
sequence shards: column layers all-gather their input, row layers reduce-scatter their output, and
the embedding reduce-scatters instead of all-reducing (Korthikanti et al. 2022).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_kernels import KernelOps
from parallel import comm
from parallel.comm import CommStats, Group
from parallel.loss import vocab_parallel_cross_entropy


def _shape(weight: torch.Tensor | None) -> tuple[int, ...] | None:
    """A weight's shape for repr; None where --zero3-fetch flat moved it into its block's flat tensors."""
    return None if weight is None else tuple(weight.shape)

class _ColumnParallelMatmul(torch.autograd.Function):
    """y = x_total W_r^T + b_r, with the input-gradient collective overlapped with the weight gradient.

    x_total is x (replicated) or, under sequence parallelism, the all-gather of the sequence shards x.
    Backward (Megatron's LinearWithGradAccumulationAndAsyncCommunication):
        grad_x  = grad_y W_r            partial over this rank's output features -> all-reduce / reduce-scatter,
                                        launched async
        grad_W  = grad_y^T x_total      computed while that collective runs
        grad_b  = sum over tokens of grad_y
    Under sequence parallelism only the shard x is saved; x_total is all-gathered again in backward,
    overlapped with grad_x. On CUDA, set CUDA_DEVICE_MAX_CONNECTIONS=1 so the collective is queued
    before the weight-gradient GEMM. Under autocast the forward matmul casts like F.linear, and backward
    computes in the output's dtype (explicit casts, so any autocast device works); autograd casts the
    returned gradients back to the parameters' dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, ops, group, sequence_parallel, stats):
        ctx.group, ctx.sequence_parallel, ctx.stats = group, sequence_parallel, stats
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        x_total = comm.all_gather_sequence(x, group, stats, "fwd") if sequence_parallel else x  # [B, T, d]
        return ops.linear(x_total, weight, bias, False)  # [B, T, n_local]

    @staticmethod
    def backward(ctx, grad):  # grad: [B, T, n_local]
        x, weight = ctx.saved_tensors
        x, weight = x.to(grad.dtype), weight.to(grad.dtype)
        group, stats, sp = ctx.group, ctx.stats, ctx.sequence_parallel
        if sp:
            staging, gather = comm.all_gather_sequence(x, group, stats, "bwd", async_op=True)
        grad_input = grad.matmul(weight)  # [B, T, d], partial sum over this rank's output features
        if sp:
            gather.wait()
            x_total = comm.finish_gather(staging, comm.group_size(group))  # [B, T, d]
            grad_input, reduce = comm.reduce_scatter_sequence(grad_input, group, stats, "bwd", async_op=True)
        else:
            x_total = x
            reduce = comm.all_reduce(grad_input, group, stats, "bwd", async_op=True)
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [B*T, n_local]
        grad_weight = grad_2d.t().matmul(x_total.reshape(-1, x_total.shape[-1]))  # [n_local, d], overlaps `reduce`
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        reduce.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


class ColumnParallelLinear(nn.Module):
    """Linear whose output features are split over the TP ranks: y_r = x W_r^T + b_r.

    The input is replicated over the group (or a sequence shard that is all-gathered first); the output
    stays split ([B, T, out/tp]), ready for a RowParallelLinear or, for the fused QKV, for whole heads of
    attention. Two paths, same function:
      - gelu or not overlap: f (or the sequence all-gather) then `ops.linear(x, w, b, gelu)`, so fused
        matmul+bias+GELU kernels keep working; the input-gradient collective runs after that backward;
      - overlap (and no GELU): `_ColumnParallelMatmul`, whose backward overlaps that collective with the
        weight gradient. Its forward matmul still goes through `ops.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: KernelOps, group: Group, *,
                 sequence_parallel: bool = False, overlap: bool = True, stats: CommStats | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [out/tp, in]
        self.bias = None if bias is None else nn.Parameter(bias)  # [out/tp]
        self.ops, self.group, self.stats = ops, group, stats
        self.sequence_parallel, self.overlap = sequence_parallel, overlap

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.ops, self.group, gelu=gelu,
                                      sequence_parallel=self.sequence_parallel, overlap=self.overlap,
                                      stats=self.stats)

    def extra_repr(self) -> str:
        return f"local weight={_shape(self.weight)}, sequence_parallel={self.sequence_parallel}, overlap={self.overlap}"


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, the autocast dtype: the matmul would cast x anyway, and communicating it cast moves
    half the bytes (as Megatron communicates activations in the compute dtype); else x unchanged."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ops: KernelOps,
                           group: Group, *, gelu: bool, sequence_parallel: bool, overlap: bool,
                           stats: CommStats | None) -> torch.Tensor:
    """x: [B, T, in] (or [B, T/tp, in] shards under SP) -> [B, T, out/tp]. Shared by the LM head."""
    x = to_compute_dtype(x)  # before f / the all-gather, so they (and their backward) move compute-dtype bytes
    # under torch.compile the synchronous path: Dynamo traces its collectives into the graph (an async handle
    # would break the graph at every layer, leaving a host-bound chain of small graphs)
    if overlap and not gelu and comm.group_size(group) > 1 and not torch.compiler.is_compiling():
        return _ColumnParallelMatmul.apply(x, weight, bias, ops, group, sequence_parallel, stats)
    if sequence_parallel:
        x = comm.gather_from_sequence(x, group, stats)  # [B, T, in]
    else:
        x = comm.copy_to_tp(x, group, stats)
    return ops.linear(x, weight, bias, gelu)


class RowParallelLinear(nn.Module):
    """Linear whose input features are split over the TP ranks: y = sum_r x_r W_r^T + b.

    Input: the split output of a ColumnParallelLinear ([B, T, in/tp]). Each rank's product is a partial
    sum; g all-reduces it (or reduce-scatters it to [B, T/tp, d] under SP), then the full bias is added
    once. GELU cannot follow a partial sum, so `gelu=True` is rejected.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, ops: KernelOps, group: Group, *,
                 sequence_parallel: bool = False, stats: CommStats | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [out, in/tp]
        self.bias = nn.Parameter(bias)  # [out], replicated; under SP each rank sees only its tokens' gradient
        self.ops, self.group, self.stats = ops, group, stats
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        if gelu:
            raise ValueError("RowParallelLinear cannot apply GELU: its local product is a partial sum over "
                             "ranks; apply GELU in the column-parallel layer before it")
        y = self.ops.linear(x, self.weight, None, False)  # [B, T, out], partial over ranks
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence(y, self.group, self.stats)  # [B, T/tp, out]
        else:
            y = comm.reduce_from_tp(y, self.group, self.stats)  # [B, T, out]
        return y + self.bias

    def extra_repr(self) -> str:
        return f"local weight={_shape(self.weight)}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split into contiguous row blocks.

    Rank r owns rows [vocab_start, vocab_start + V/tp). Tokens outside the block look up row 0 and are
    zeroed, so summing the ranks' outputs (all-reduce, or reduce-scatter under SP) gives the full lookup.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: Group, *,
                 sequence_parallel: bool = False, stats: CommStats | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [V/tp, d]
        self.vocab_start = vocab_start
        self.group, self.stats, self.sequence_parallel = group, stats, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start  # [B, T]
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [B, T, d]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sequence(out, self.group, self.stats)  # [B, T/tp, d]
        return comm.reduce_from_tp(out, self.group, self.stats)  # [B, T, d]

    def extra_repr(self) -> str:
        return f"local weight={tuple(self.weight.shape)}, vocab_start={self.vocab_start}"


class SequenceShardedEmbedding(nn.Module):
    """Position embedding under sequence parallelism: the full table, returning this rank's positions.

    forward(pos [T]) -> [T/tp, d], which broadcasts against the token embedding's [B, T/tp, d] shard.
    The split's backward all-gathers the [T/tp, d] gradients, so the (replicated) table gets its full
    gradient on every rank and needs no extra all-reduce.
    """

    def __init__(self, weight: torch.Tensor, group: Group, stats: CommStats | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)  # [n_positions, d]
        self.group, self.stats = group, stats

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return comm.scatter_to_sequence(F.embedding(pos, self.weight), self.group, self.stats, dim=0)


class VocabParallelLMHead(nn.Module):
    """Tied LM head over the vocab-parallel embedding's shard; the full logits are never gathered for the loss.

    forward(hidden, targets) -> (mean loss, n_correct top-1), or logits [B, T, vocab_size] when targets
    is None (the only path that all-gathers the vocabulary). hidden is [B, T, d], or [B, T/tp, d] shards
    under SP (all-gathered here). The logits matmul is a bias-free column-parallel linear, so it shares
    the overlapped backward. Vocab-parallel logits rule out the fused LM-head cross-entropy of `ops`.
    """

    def __init__(self, weight: nn.Parameter, vocab_start: int, vocab_size: int, ops: KernelOps, group: Group, *,
                 sequence_parallel: bool = False, overlap: bool = True, stats: CommStats | None = None):
        super().__init__()
        self.weight = weight  # [V/tp, d], the same Parameter as VocabParallelEmbedding.weight
        self.vocab_start, self.vocab_size = vocab_start, vocab_size
        self.ops, self.group, self.stats = ops, group, stats
        self.sequence_parallel, self.overlap = sequence_parallel, overlap

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None):
        logits = column_parallel_linear(hidden, self.weight, None, self.ops, self.group, gelu=False,
                                        sequence_parallel=self.sequence_parallel, overlap=self.overlap,
                                        stats=self.stats)  # [B, T, V/tp]
        if targets is None:
            return comm.gather_from_tp(logits, self.group, self.stats)[..., : self.vocab_size]  # [B, T, V]
        return vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            self.vocab_start, self.vocab_size, self.group, self.stats)
