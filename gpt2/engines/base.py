"""What every engine is and shares: the `Engine` protocol the loop and the checkpoints use, the LR schedule, and
token-weighted evaluation over the data-parallel group.

An engine executes one optimizer step of its mode (`gpt2.engines.torch_engine`: single and DDP;
`gpt2.engines.deepspeed_engine`: ZeRO; `gpt2.engines.fsdp2_engine`: ZeRO by FSDP2) and holds the model, optimizer and
schedule; `gpt2.engines.build` picks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
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
    def save_state(self, folder: Path, step: int) -> None:
        """Write model, optimizer and schedule state into a checkpoint's step folder (collective)."""
    def load_state(self, folder: Path) -> int | None:
        """Restore what `save_state` wrote, the LR recomputed from this run's schedule (collective); returns the
        step the state records, where it records one, for the caller to check against its own."""


def state_file(folder: Path, name: str, tp_rank: int, tp_size: int) -> Path:
    """`model` / `optimizer` state of single/baseline checkpoints: one file, or one per TP rank (TP layout)."""
    return folder / (f"{name}.pt" if tp_size == 1 else f"{name}-tp{tp_rank:02d}.pt")


def resync_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """Recompute a restored step's LR from this run's schedule: a checkpoint holds the LR its own schedule gave,
    which is stale when a resume changes --max-steps, --lr, --min-lr or --warmup-steps."""
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)  # every param group trains at --lr (x the schedule)
    scheduler.last_epoch -= 1
    scheduler.step()  # LambdaLR: lr = base_lr x lambda(last_epoch), set on the optimizer and as get_last_lr()


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
