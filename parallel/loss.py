"""Vocab-parallel cross-entropy: the loss over logits split by vocabulary, without gathering them.

Rank r holds logits z[:, v] for v in its block [s, s + V/tp) of the padded vocabulary. For one token
with target t (Megatron-LM's `_VocabParallelCrossEntropy`):

    m    = max_v z_v                    all-reduce MAX (numerical stability only)
    S    = sum_v exp(z_v - m)           all-reduce SUM of the local sums
    z_t  = the target's logit            all-reduce SUM (only the owning rank contributes)
    loss = log S - (z_t - m)
    dloss/dz_v = softmax_v - [v == t]   local: each rank differentiates its own columns

Padded vocabulary columns (v >= vocab_size) are set to -inf, so they get zero probability and gradient;
targets equal to -100 are ignored (zero loss and gradient, left out of the mean). Top-1 correctness uses
the same global max: each rank proposes its first column attaining it, and an all-reduce MIN picks the
smallest, which is `torch.argmax`'s tie rule on the full logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import comm
from parallel.comm import CommStats, Group

IGNORE_INDEX = -100


def _all_reduce(x: torch.Tensor, group: Group, stats: CommStats | None, op: dist.ReduceOp) -> None:
    if comm.group_size(group) > 1:
        comm.all_reduce(x, group, stats, "fwd", op=op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, stats):
        # logits: [N, V/tp] this rank's columns [vocab_start, vocab_start + V/tp); targets: [N] global ids
        n_local = logits.shape[-1]
        columns = torch.arange(vocab_start, vocab_start + n_local, device=logits.device)  # [V/tp]
        z = logits.float().masked_fill(columns >= vocab_size, float("-inf"))  # [N, V/tp]

        local_max, local_arg = z.max(dim=-1)  # [N], [N]
        global_max = local_max.clone()
        _all_reduce(global_max, group, stats, dist.ReduceOp.MAX)
        exp = (z - global_max.unsqueeze(-1)).exp_()  # [N, V/tp]; padded columns: exp(-inf) = 0
        sum_exp = exp.sum(dim=-1)  # [N]
        _all_reduce(sum_exp, group, stats, dist.ReduceOp.SUM)

        local_t = targets - vocab_start  # [N]
        owned = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.masked_fill(~owned, 0)
        target_z = z.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~owned, 0.0)  # [N]
        _all_reduce(target_z, group, stats, dist.ReduceOp.SUM)

        valid = targets != IGNORE_INDEX
        loss = (sum_exp.log() + global_max - target_z).masked_fill(~valid, 0.0)  # [N]

        big = torch.iinfo(torch.long).max
        candidate = torch.where(local_max == global_max, local_arg + vocab_start, big)  # [N]
        _all_reduce(candidate, group, stats, dist.ReduceOp.MIN)
        n_correct = (candidate == targets).sum()  # ignored targets (-100) never match

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [N, V/tp], reuses the exp buffer
        ctx.save_for_backward(softmax, local_t, owned & valid, valid)
        ctx.mark_non_differentiable(n_correct)
        return loss, n_correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):  # grad_loss: [N]
        softmax, local_t, target_here, valid = ctx.saved_tensors
        grad = softmax.clone()  # [N, V/tp]
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= target_here.to(grad.dtype)  # softmax - one_hot(target), on the owning rank
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, group: Group,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss over non-ignored targets and the count of correct top-1 predictions (same on every rank).

    logits [N, V/tp] (this rank's vocabulary block starting at `vocab_start`), targets [N] (-100 ignored).
    Matches `fused_kernels.reference.lm_cross_entropy` on the full logits.
    """
    loss, n_correct = _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, vocab_size, group, stats)
    return loss.sum() / (targets != IGNORE_INDEX).sum(), n_correct
