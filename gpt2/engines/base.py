"""What every engine is and shares: the `Engine` protocol the loop and the checkpoints use, the LR schedule, and
token-weighted evaluation over the data-parallel group.

An engine executes one optimizer step of its mode (`gpt2.engines.torch_engine`: single and DDP;
`gpt2.engines.deepspeed_engine`: ZeRO) and holds the model, optimizer and schedule; `gpt2.engines.build` picks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from gpt2.config.schema import TrainConfig
from gpt2.engines.guard import NonFiniteGuard
from gpt2.runtime.distributed import DistContext

CHECKPOINT_TAG = "zero"  # DeepSpeed's sub-folder inside one of our step folders (gpt2.train.checkpoint)


class Engine(Protocol):
    """One mode's optimizer step over the model it built; what the loop calls."""

    guard: NonFiniteGuard
    module: torch.nn.Module

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, last_micro_step: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def optimizer_step(self) -> torch.Tensor: ...
    def evaluate(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]: ...
    @property
    def lr(self) -> float: ...


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to lr over warmup_steps, then cosine decay to min_lr at max_steps (0-based step)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


@torch.no_grad()
def evaluate_batches(
    forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    ctx: DistContext,
) -> tuple[float, float]:
    """Token-weighted mean loss and top-1 accuracy of `forward` over `batches`, summed over the DP group."""
    totals = torch.zeros(3, device=ctx.device, dtype=torch.float64)  # loss*tokens, correct, tokens
    for x, y in batches:
        x, y = x.to(ctx.device), y.to(ctx.device)
        loss, correct = forward(x, y)
        totals[0] += loss.double() * y.numel()
        totals[1] += correct.double()
        totals[2] += y.numel()
    if ctx.distributed:
        dist.all_reduce(totals, group=ctx.dims.dp_group)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
