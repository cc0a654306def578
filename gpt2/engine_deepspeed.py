"""`--mode hybrid`: DeepSpeed ZeRO (stage 3 by default; 1 and 2 for comparison) behind the engine interface.

    deepspeed --num_gpus=4 train.py --mode hybrid --model gpt2-large             # ZeRO-3, ds_configs/zero3.json
    torchrun --nproc_per_node=4 train.py --mode hybrid --zero-stage 2            # ds_configs/zero2.json
    torchrun --nproc_per_node=4 train.py --mode hybrid --ds-config my.json --zero-stage 3

Same interface as `gpt2.engine.TorchEngine` (forward_backward / optimizer_step / evaluate / lr / module),
so the loop, metrics and logs are shared. Our CLI stays the single source of truth: batch size, gradient
accumulation, clipping, precision and ZeRO stage are written into the DeepSpeed config, and a JSON file
that sets one of them to another value is an error naming both. The optimizer (torch AdamW, fused on CUDA)
and the LR schedule (LambdaLR over `gpt2.engine.lr_at`) are our objects passed to `deepspeed.initialize`,
so no DeepSpeed op needs compiling.

`--zero3-fetch block` (default) marks each transformer block a DeepSpeed ZeRO-3 leaf module: its parameters
are gathered by one coalesced all-gather in one pre-forward hook (and again before its backward) instead of
by hooks on each of its ~10 submodules (fewer hooks and collectives: 1.3x steps/s on a 2-rank CPU run, no change
on 4xH200 at batch 8), and lets `--compile` compile each block's forward with the hooks outside the graph.
A gathered block is 12d^2 parameters (GPT-2 Large: 19.7M, 39 MB in bf16). `--zero3-fetch module` keeps
DeepSpeed's default per-module hooks.

Under ZeRO-3 the model is built inside `deepspeed.zero.Init`: each module's parameters are partitioned
over the data-parallel group as soon as its constructor returns, so GPT-2 Large/XL never exist whole on
one device. Our modules initialise in their constructors (see `gpt2.model`), which zero.Init runs on the
full tensor before partitioning it: with the same seed the weights equal those of the plain build in fp32
(tests/test_zero.py checks it). In bf16/fp16, zero.Init creates the parameters in that dtype, so the
initial weights are the rounded fp32 ones (DeepSpeed keeps fp32 master copies from there). The tied LM
head is the same Parameter as `wte.weight`, registered in `LMHead` as well: ZeRO-3 gathers it in both
modules' forward hooks and accumulates both gradient contributions.

With --tp-size > 1, our tensor parallelism runs inside DeepSpeed: `ModelParallelUnit(dims)` is the `mpu`, so
ZeRO partitions parameters, gradients and optimizer states over the data-parallel group only (each TP rank's
shard of a weight is a different tensor, partitioned among its DP peers), reduces the gradients of sharded
weights over DP only, and sums gradient norms over the TP group (the plan's `tensor_model_parallel` marks).
Sequence-parallel gradients are summed over TP by hooks registered before `deepspeed.initialize`. The TP model
is NOT built under zero.Init (the plan cuts existing full weights): the full fp32 model exists on every device
between its construction and `deepspeed.initialize` (GPT-2 XL: 6 GB per GPU, transiently), then only this
rank's TP shard, partitioned over DP, is kept.

On CPU (tests): `DS_ACCELERATOR=cpu`, gloo, fp32. DeepSpeed's CPU communication backend would JIT-build a
shared-memory all-reduce op that only its inference path uses; we mark it incompatible instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fused_kernels import get_ops
from fused_kernels.attention import get_attention
from gpt2.checkpoint import CHECKPOINT_TAG
from gpt2.compiling import compile_forwards, compile_model
from gpt2.config import ConfigError, RunConfig
from gpt2.distributed import DistContext
from gpt2.ds_config import build_ds_config
from gpt2.engine import build_model, evaluate_batches, lr_at
from gpt2.layout import RunLayout
from gpt2.model import GPT, Block
from gpt2.run_logging import log
from parallel.comm import CommStats
from parallel.dims import ParallelDims
from parallel.grads import register_sequence_parallel_grad_hooks
from parallel.mpu import ModelParallelUnit


def _import_deepspeed(device: torch.device):
    """Import DeepSpeed with the accelerator matching our device; never JIT-build an op on CPU."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator().device_name()
    if accel != device.type:
        raise ConfigError(f"DeepSpeed's accelerator is {accel!r} but the run uses {device.type!r}; "
                          f"set DS_ACCELERATOR={device.type} (or drop --device)")
    if device.type == "cpu":
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False  # read by deepspeed.comm at init
    # wraps the process group init_distributed() created; zero.Init reads the world size through it
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    return deepspeed


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """`gpt2.engine.param_groups` by the parameters' full shapes (ZeRO-3 partitions are 1-D)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()  # tied weights once
    decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _build_zero3_model(cfg: RunConfig, ds_config: dict, dims: ParallelDims, deepspeed) -> GPT:
    """GPT-2 partitioned at construction; the seed draws the same values as `build_model` (fp32)."""
    ops = get_ops(cfg.train.fused_kernels)
    attention = get_attention(cfg.train.attn)
    torch.manual_seed(cfg.train.seed)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=ModelParallelUnit(dims)):
        model = GPT(cfg.model, ops=ops, attention=attention)
    if cfg.train.init_from:
        from gpt2.hf_weights import load_hf_state_dict

        # one parameter at a time: rank 0 writes the full tensor, DeepSpeed re-partitions it on exit
        sd = load_hf_state_dict(cfg.train.init_from, cfg.model) if dims.rank == 0 else None
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                if sd is not None:
                    p.copy_(sd[name])
    return model


class ZeroCommLog:
    """Bytes per collective kind from DeepSpeed's comms logger (`--comm-log`), in CommStats' convention: the
    full (unsharded) tensor of each collective. The logger records an all-gather by its input (this rank's
    shard), so those are scaled by the data-parallel size (ZeRO gathers over the DP group).

    The logger is DeepSpeed's process-wide object; `reset` clears it. It records only collectives called
    through `deepspeed.comm` (ZeRO's), not our TP layers' (torch.distributed directly).
    """

    KINDS = {"all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
             "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce"}

    def __init__(self, dp_size: int):
        import deepspeed.comm

        self.dp_size = dp_size
        self.logger = deepspeed.comm.comms_logger

    def reset(self) -> None:
        self.logger.reset_data()

    def bytes_by_collective(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, sizes in self.logger.comms_dict.items():
            kind = self.KINDS.get(name, name)
            scale = self.dp_size if name.startswith("all_gather") else 1
            out[kind] = out.get(kind, 0.0) + sum(size * record[0] * scale for size, record in sizes.items())
        return out


class DeepSpeedEngine:
    """ZeRO-1/2/3 training; `engine` is the DeepSpeed engine, `module` our GPT inside it."""

    def __init__(self, layout: RunLayout, ctx: DistContext):
        self.cfg = cfg = layout.cfg
        self.layout = layout
        self.ctx = ctx
        t = cfg.train
        stage = layout.zero_stage
        deepspeed = _import_deepspeed(ctx.device)
        self.ds_config = build_ds_config(layout)
        if cfg.parallel.comm_log:  # every collective synchronises: measurement runs only
            self.ds_config["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
        log.info("DeepSpeed config: %s", json.dumps(self.ds_config, sort_keys=True))
        # our TP collectives' bytes, counted in eager runs (RunLayout.counts_tp_comm)
        self.comm_stats = CommStats() if layout.counts_tp_comm else None
        if stage == 3 and ctx.dims.tp_size == 1:
            model = _build_zero3_model(cfg, self.ds_config, ctx.dims, deepspeed)
        else:
            if stage == 3:
                log.info("ZeRO-3 with --tp-size %d: building the full model on every device (not under zero.Init), "
                         "cutting it into TP shards, then partitioning each shard over the DP group",
                         ctx.dims.tp_size)
            model = build_model(cfg, ctx.device, ctx.dims, self.comm_stats)
        model.activation_checkpointing = t.activation_checkpointing
        zero3_blocks = layout.zero3_blocks
        if zero3_blocks:  # before initialize, which registers the hooks: one per block instead of ~10
            from deepspeed.utils import set_z3_leaf_modules

            leaves = set_z3_leaf_modules(model, [Block])
            log.info("ZeRO-3 gathers parameters per transformer block (%d DeepSpeed leaf modules)", len(leaves))
        if t.compile:  # with ZeRO-3 only when blocks are leaves (config.validate)
            compile_forwards(model) if zero3_blocks else compile_model(model)
        if cfg.parallel.sequence_parallel:  # before initialize: ZeRO consumes gradients during backward
            register_sequence_parallel_grad_hooks(model, ctx.dims, self.comm_stats)
        optimizer = torch.optim.AdamW(_param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                      fused=ctx.device.type == "cuda")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, t) / t.lr)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            mpu=ModelParallelUnit(ctx.dims), dist_init_required=False)
        self._step_lr = self.scheduler.get_last_lr()[0]  # the lr of the last optimizer step
        self.module: GPT = model
        self.zero_comm_log = ZeroCommLog(ctx.dims.dp_size) if cfg.parallel.comm_log else None

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, last_micro_step: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-step; DeepSpeed divides the loss by grad_accum and steps only at the boundary."""
        loss, correct = self.engine(x, y)
        self.engine.backward(loss)
        if not last_micro_step:
            self.engine.step()  # bookkeeping only: DeepSpeed counts micro-steps in step()
        return loss.detach(), correct.detach()

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step, schedule (all inside DeepSpeed); returns the pre-clip global gradient norm."""
        self._step_lr = self.scheduler.get_last_lr()[0]  # this update's lr; engine.step() schedules the next
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else float(norm))

    @property
    def lr(self) -> float:
        """The learning rate the last optimizer step used (logged with that step; before any step: the first's)."""
        return self._step_lr

    def evaluate(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Mean loss and top-1 accuracy over `batches`, averaged over the data-parallel group."""
        self.engine.eval()
        result = evaluate_batches(self.engine, batches, self.ctx)
        self.engine.train()
        return result

    def save_sharded(self, folder: Path, client_state: dict[str, Any]) -> None:
        """DeepSpeed's sharded checkpoint into folder/zero (collective: every rank calls it)."""
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, client_state=client_state, save_latest=False)

    def load_sharded(self, folder: Path) -> dict[str, Any]:
        """Load model, optimizer and scheduler shards; returns the client state."""
        path, client_state = self.engine.load_checkpoint(
            str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load the checkpoint in {folder / CHECKPOINT_TAG}")
        return client_state
