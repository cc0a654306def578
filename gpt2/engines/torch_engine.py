"""Training engines: how one optimizer step is executed in each mode.

- `TorchEngine`: `--mode single` (one device) and `--mode baseline` (DDP over the data-parallel
  group; `no_sync` on all but the last micro-step of gradient accumulation), with our tensor
  parallelism inside when --tp-size > 1.
- The DeepSpeed engine (`--mode hybrid`) implements the same interface; the FSDP2 engine (`--mode hybrid
  --zero-engine fsdp2`) is this one with FSDP2's sharding in place of DDP (`wrap`, `no_sync`, `grad_norm`).

Build order (torchtitan's, `gpt2.runtime.parallelize`): full model on the target device from the seed -> weights from
--init-from -> tensor parallelism (each rank keeps its shards) -> activation checkpointing -> torch.compile per
block -> data-parallel wrapper over the DP group (-> a whole-model compile) -> optimizer.
`gpt2.engines.build.build_engine`
picks the engine of the run's mode.

DDP + TP: each TP rank's shards have their own DDP replicas (DDP over `dims.dp_group`), so a sharded
weight's gradient is averaged over DP only; replicated parameters get the same gradient on every TP rank
and stay identical. With --sequence-parallel, the replicated parameters used on sequence shards
(LayerNorms, row-parallel biases) are summed over the TP group after the step's last backward; clipping
uses the TP-aware global norm (`parallel.grads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gpt2.config.layout import RunLayout
from gpt2.engines.base import evaluate_batches, lr_at, resync_lr, state_file
from gpt2.engines.guard import NonFiniteGuard, clip_divisor, step_if_finite
from gpt2.runtime.compiling import compile_whole
from gpt2.runtime.distributed import DistContext
from gpt2.runtime.parallelize import build_model, parallelize, param_groups, tp_comm_stats
from parallel.grads import allreduce_sequence_parallel_grads, grad_norm


class TorchEngine:
    """Single-device or DDP training with autocast, GradScaler (fp16), clipping, fused AdamW (the Triton one with
    --optimizer triton: `RunLayout.triton_adamw`) and the non-finite guard (`gpt2.engines.guard`): a step whose
    global gradient norm is not finite updates nothing."""

    def optimizer_factory(self) -> Callable[..., torch.optim.AdamW]:
        """torch's AdamW, or with --optimizer triton the Triton AdamW (imported only then: Triton)."""
        if self.layout.triton_adamw:
            from fused_kernels.triton.adamw import TritonAdamW

            return TritonAdamW
        return torch.optim.AdamW

    def __init__(self, layout: RunLayout, ctx: DistContext):
        self.cfg = cfg = layout.cfg
        self.layout = layout
        self.ctx = ctx
        t = cfg.train
        self.comm_stats = tp_comm_stats(layout)
        model = parallelize(build_model(layout, ctx.device, ctx.dims), layout, ctx.dims, self.comm_stats)
        self.module = model
        self.ddp: DistributedDataParallel | None = None
        self.model: nn.Module = self.wrap(model)
        if layout.compile_scope == "model":
            self.model = compile_whole(self.model, layout.inductor_cpp_wrapper)
        self.dtype = layout.autocast_dtype
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.dtype == torch.float16)
        # fused on every device: it skips a non-finite step on the device (`step_if_finite`); the Triton AdamW
        # keeps fused AdamW's state (step counts on the device, where its kernel reads them)
        self.optimizer = self.optimizer_factory()(
            param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_at(s, t) / t.lr)
        self._step_lr = self.scheduler.get_last_lr()[0]  # the lr of the last optimizer step
        self.guard = NonFiniteGuard.for_run(layout, ctx.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The data-parallel wrapper (built before the optimizer): DDP over the DP group (baseline), else none.
        (`gpt2.engines.fsdp2_engine.FSDP2Engine` shards the model here instead.)"""
        if self.layout.mode == "baseline":
            device = self.ctx.device
            self.ddp = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                process_group=self.ctx.dims.dp_group, gradient_as_bucket_view=True,
                bucket_cap_mb=self.cfg.train.ddp_bucket_mb)
        return self.ddp or model

    def no_sync(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """No gradient reduction on the micro-steps before the step's last (DDP's no_sync)."""
        sync = last_micro_step or self.ddp is None
        return contextlib.nullcontext() if sync else self.ddp.no_sync()

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The global gradient norm (multi-tensor or Triton kernels, no host sync); TP-aware with tensor
        parallelism."""
        if self.ctx.dims.tp_size > 1:
            return grad_norm(params, self.ctx.dims)  # sharded weights' squares summed over TP
        if self.layout.triton_adamw:
            return self.optimizer.grad_norm()  # the Triton kernels', over the optimizer's parameters: `params`
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=self.dtype)

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, last_micro_step: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-step; returns the (detached, unscaled) mean loss and the correct-token count."""
        with self.no_sync(last_micro_step):
            with self.autocast():
                loss, correct = self.model(x, y)
            self.scaler.scale(self.guard.gate(loss) / self.layout.grad_accum).backward()
        if last_micro_step and self.layout.sequence_parallel:
            allreduce_sequence_parallel_grads(self.module, self.ctx.dims, self.comm_stats)
        return loss.detach(), correct.detach()

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step unless the global gradient norm is not finite (decided on the device), schedule; returns the
        pre-clip global gradient norm (a device tensor). The clipping is the update's: its kernel divides each
        gradient by `clip_divisor` as it reads it (one pass over the gradients for the norm, one for the update)."""
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.train.grad_clip
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = self.grad_norm(params)
        # fp16: an inf/NaN gradient the scaler found makes the norm non-finite too, so this skips what
        # scaler.step would; the scaler still backs off from the inf checks unscale_ recorded
        step_if_finite(self.optimizer, norm, clip_divisor(norm, clip) if clip > 0 else None)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self._step_lr = self.scheduler.get_last_lr()[0]  # this update's lr; scheduler.step() moves to the next
        self.scheduler.step()  # a skipped update still uses up its step of the schedule (no host sync to know)
        return norm

    @property
    def lr(self) -> float:
        """The learning rate the last optimizer step used (logged with that step; before any step: the first's)."""
        return self._step_lr

    def evaluate(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Mean loss and top-1 accuracy over `batches`, averaged over the data-parallel group."""
        def forward(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with self.autocast():
                return self.module(x, y)

        self.model.eval()
        result = evaluate_batches(forward, batches, self.ctx)
        self.model.train()
        return result

    def save_state(self, folder: Path, step: int) -> None:
        """Model and optimizer/scheduler/scaler state, from data-parallel rank 0 of each TP rank: DDP replicas are
        identical, each TP rank holds different shards (the files are `weights_only` loadable)."""
        tp_rank, tp_size = self.ctx.dims.tp_rank, self.ctx.dims.tp_size
        if self.ctx.dims.dp_rank == 0:
            torch.save(self.module.state_dict(), state_file(folder, "model", tp_rank, tp_size))
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "scaler": self.scaler.state_dict()}, state_file(folder, "optimizer", tp_rank, tp_size))

    def load_state(self, folder: Path) -> int | None:
        """Every rank reads its TP rank's files; the files record no step (meta.json does)."""
        dims, device = self.ctx.dims, self.ctx.device
        self.module.load_state_dict(torch.load(state_file(folder, "model", dims.tp_rank, dims.tp_size),
                                               map_location=device, weights_only=True))
        state = torch.load(state_file(folder, "optimizer", dims.tp_rank, dims.tp_size), map_location=device,
                           weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        resync_lr(self.scheduler, self.cfg.train.lr)
        return None
