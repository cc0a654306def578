"""`--mode hybrid`: DeepSpeed ZeRO (stage 3 by default; 1 and 2 for comparison) behind the engine interface.

    deepspeed --num_gpus=4 train.py --mode hybrid --model gpt2-large   # ZeRO-3, gpt2/config/ds_configs/zero3.json
    torchrun --nproc_per_node=4 train.py --mode hybrid --zero-stage 2  # gpt2/config/ds_configs/zero2.json
    torchrun --nproc_per_node=4 train.py --mode hybrid --ds-config my.json --zero-stage 3

Same interface as `gpt2.engines.torch_engine.TorchEngine` (forward_backward / optimizer_step / evaluate / lr / module),
so the loop, metrics and logs are shared. Our CLI stays the single source of truth: batch size, gradient
accumulation, clipping, precision and ZeRO stage are written into the DeepSpeed config, and a JSON file
that sets one of them to another value is an error naming both. The optimizer (torch AdamW, fused, as in
TorchEngine) and the LR schedule (LambdaLR over `gpt2.engines.base.lr_at`) are our objects passed to
`deepspeed.initialize`, so no DeepSpeed op needs compiling.

`--zero3-fetch flat` (default) and `block` mark each unit of `--zero3-unit-blocks` transformer blocks (default 4) a
DeepSpeed ZeRO-3 leaf module: its parameters are gathered by one coalesced all-gather in one pre-forward hook (and
again before its backward) instead of by hooks on each of its submodules, and `--compile` compiles each unit's
forward with the hooks outside the graph. A gathered block is 12d^2 parameters (GPT-2 Large: 19.7M, 39 MB in bf16).
`flat` keeps each unit's parameters in 3-4 flat tensors (`gpt2.runtime.flat_blocks`): less of DeepSpeed's per-tensor
host work, which bounds the step at small batches (docs/decisions.md);
the model is then built whole, as under TP, and `save_state` writes the flat layout beside DeepSpeed's files for
export. `--zero3-fetch module` keeps DeepSpeed's default per-module hooks.

Under ZeRO-3 with `--zero3-fetch block` or `module`, without TP, the model is built inside `deepspeed.zero.Init`:
each module's parameters are partitioned over the data-parallel group as soon as its constructor returns, so the
model never exists whole on one device. Our modules initialise in their constructors (see `gpt2.model.gpt`), which
zero.Init runs on the full tensor before partitioning it: with the same seed the weights equal those of the plain
build (tests/integration/test_zero.py checks it). bf16/fp16 is DeepSpeed's torch_autocast by default (`--zero-precision
autocast`,
gpt2.config.deepspeed_file.precision_values): fp32 weights and the forward under torch.autocast, as in single and DDP.
With `--zero-precision deepspeed`, zero.Init creates 16-bit parameters, the rounded fp32 ones, and DeepSpeed
keeps fp32 master copies from there: another function (see the parity results). The tied LM
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

`--compile --compiler deepcompile` (ZeRO-3, CUDA, tp 1): the ds config gets compile.deepcompile=true and, after
`deepspeed.initialize`, `engine.compile()` hands the whole model to DeepSpeed's DeepCompile: ZeRO-3's module hooks
are removed and the parameters' all-gathers/releases and the gradients' reduce-scatters become ops in the compiled
graphs, prefetched and selectively kept gathered after 5 profiled steps. Nothing else changes: the same zero.Init
build, ZeRO-3 keys, optimizer, clipping and overflow check: by DeepSpeed's code (deepspeed/compile/init_z3.py) its op
reduces each gradient into ZeRO-3's own partition buffer, and `engine.step()` computes the norm, clips and skips from
there as without it: it trains single's function within the GPU parity gate, both compiles included
(tests/unit/test_deepcompile.py -m gpu, parity row zero3-deepcompile; docs/decisions.md).
Its evaluation graphs compile under `gpt2.runtime.compiling.deepcompile_eval_settings`.

Non-finite guard (`gpt2.engines.guard`): the loss passes through `guard.gate` before `engine.backward`, so a non-finite
loss
makes the gradients NaN, and DeepSpeed's own check skips every step whose global gradient norm is not finite
(ZeRO-1/2/3; `gpt2.config.deepspeed_file` keeps `bf16.check_grad_overflow` and `zero_optimization.compute_grad_norm`
on).
DeepSpeed
then leaves the LR schedule where it is; we step it, so that a skipped update uses up its step of the schedule as in
TorchEngine. DeepSpeed reads its decision on the host inside `engine.step()`; asking it afterwards costs nothing.

On CPU (tests): `DS_ACCELERATOR=cpu`, gloo, fp32. DeepSpeed's CPU communication backend would JIT-build a
shared-memory all-reduce op that only its inference path uses; we mark it incompatible instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpt2.config.deepspeed_file import build_ds_config
from gpt2.config.layout import RunLayout
from gpt2.config.schema import ConfigError
from gpt2.engines.base import CHECKPOINT_TAG, evaluate_batches, lr_at, resync_lr
from gpt2.engines.guard import NonFiniteGuard
from gpt2.model.gpt import GPT
from gpt2.observe.run_logging import log
from gpt2.runtime.compiling import apply_inductor_settings, deepcompile_eval_settings
from gpt2.runtime.distributed import DistContext
from gpt2.runtime.flat_blocks import save_layout
from gpt2.runtime.parallelize import build_model, parallelize, param_groups, tp_comm_stats
from parallel.grads import register_sequence_parallel_grad_hooks
from parallel.mpu import ModelParallelUnit


def import_deepspeed(device: torch.device):
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


def set_deepspeed_nvtx(enabled: bool) -> None:
    """Turn DeepSpeed's NVTX ranges on or off (process-wide; read at each call of a ZeRO function it wraps).

    DeepSpeed wraps ~64 ZeRO functions in `instrument_w_nvtx`: a range push and pop per call, ~3,300 pairs a ZeRO-3
    step of GPT-2 Large, each a host call that only an Nsight Systems timeline reads.
    """
    import deepspeed.utils.nvtx

    deepspeed.utils.nvtx.enable_nvtx = enabled


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


# DeepCompile's scheduler walks the FX graph with a recursive DFS, one Python frame per node of the longest chain
# (deepspeed/compile/list_schedule.py `get_node_requirements`): GPT-2 Large's forward graph has a 1,453-node chain,
# past Python's default limit of 1,000, so the first GPU run stopped with RecursionError (gpt2: 493, ran). The frames
# are Python-only (no C stack since Python 3.11), so a limit far above any GPT-2's graph is safe.
DEEPCOMPILE_RECURSION_LIMIT = 100_000


@contextlib.contextmanager
def arch_list_deepspeed_can_parse() -> Iterator[None]:
    """TORCH_CUDA_ARCH_LIST without arch-specific suffixes (`9.0a` -> `9.0`) while inside.

    DeepSpeed's JIT builder (0.19.8, op_builder/builder.py `compute_capability_args`) reads each entry as digits, so
    an entry PyTorch accepts, such as `9.0a` (which Hopper images set), stops the build of its DeepCompile op with
    `invalid literal for int() with base 10: '0a'`. That op uses no arch-specific instruction."""
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if old is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)[a-z]\b", r"\1", old)
    try:
        yield
    finally:
        if old is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old


@contextlib.contextmanager
def zero3_master_shares_fp32_weights() -> Iterator[None]:
    """While inside, ZeRO-3's optimizer uses the fp32 weights' own partitions as its fp32 master copy, as DeepSpeed
    means to when their dtype is the master's (fp32 weights: `torch_autocast`, our default, or fp32 training).

    DeepSpeed 0.19.8 `DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions` shares them only if
    `weights.device == self.device`, but `self.device` is `get_accelerator().current_device_name()`, a str, and a
    torch.device never equals a str, so it clones: one more fp32 copy of the model, 1/dp of it per rank (GPT-2
    Large at world size 1: 2.88 GiB; benchmarks/repro/deepspeed_master_weight_copies.py shows it). The comparison
    runs with `self.device` as a torch.device here, which names the same device wherever DeepSpeed uses it."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original = Stage3._create_fp32_partitions

    def create_fp32_partitions(optimizer: Any) -> None:
        device = optimizer.device
        if isinstance(device, str):  # as in 0.19.8; a release that stores a torch.device needs no help
            optimizer.device = torch.device(device)
        try:
            original(optimizer)
        finally:
            optimizer.device = device
        groups = list(zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat))
        log.info("ZeRO-3: the fp32 master shares %d of %d weight partitions (no second fp32 copy of those)",
                 sum(master is weights for master, weights in groups), len(groups))

    Stage3._create_fp32_partitions = create_fp32_partitions
    try:
        yield
    finally:
        Stage3._create_fp32_partitions = original


class DeepSpeedEngine:
    """ZeRO-1/2/3 training; `engine` is the DeepSpeed engine, `module` our GPT inside it."""

    def __init__(self, layout: RunLayout, ctx: DistContext):
        self.cfg = cfg = layout.cfg
        self.layout = layout
        self.ctx = ctx
        t = cfg.train
        stage = layout.zero_stage
        deepspeed = import_deepspeed(ctx.device)
        set_deepspeed_nvtx(cfg.parallel.deepspeed_nvtx)
        self.ds_config = build_ds_config(layout)
        if cfg.parallel.comm_log:  # every collective synchronises: measurement runs only
            self.ds_config["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
        log.info("DeepSpeed config: %s", json.dumps(self.ds_config, sort_keys=True))
        self.comm_stats = tp_comm_stats(layout)
        if stage == 3 and layout.tp_size > 1:
            log.info("ZeRO-3 with --tp-size %d: building the full model on every device (not under zero.Init), "
                     "cutting it into TP shards, then partitioning each shard over the DP group", layout.tp_size)
        # whole models: the TP plan and --zero3-fetch flat cut or concatenate existing full weights
        zero3 = (deepspeed, self.ds_config) if stage == 3 and layout.tp_size == 1 and not layout.zero3_flat else None
        model = parallelize(build_model(layout, ctx.device, ctx.dims, zero3), layout, ctx.dims, self.comm_stats)
        if stage == 3:  # host work: ZeRO-3 walks this tree at every forward's start and end (flat units hide theirs)
            log.info("ZeRO-3 module tree: %d modules", sum(1 for _ in model.modules()))
        if cfg.parallel.sequence_parallel:  # before initialize: ZeRO consumes gradients during backward
            register_sequence_parallel_grad_hooks(model, ctx.dims, self.comm_stats)
        optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                      fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, t) / t.lr)
        # not under DeepCompile: its passes use the ZeRO-3 buffers, and no GPU run has checked them with the sharing
        with zero3_master_shares_fp32_weights() if stage == 3 and not layout.deepcompile else contextlib.nullcontext():
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
                mpu=ModelParallelUnit(ctx.dims), dist_init_required=False)
        if layout.deepcompile:
            self._deepcompile()
        self._step_lr = self.scheduler.get_last_lr()[0]  # the lr of the last optimizer step
        self.module: GPT = model
        self.zero_comm_log = ZeroCommLog(ctx.dims.dp_size) if cfg.parallel.comm_log else None
        self.guard = NonFiniteGuard.for_run(layout, ctx.device)

    def _deepcompile(self) -> None:
        """`engine.compile()` under the config's compile.deepcompile: DeepSpeed removes ZeRO-3's module hooks and
        compiles the whole model with Inductor, inserting each parameter's all-gather and release and each
        gradient's reduce-scatter into the graphs; after 5 steps it re-compiles with its prefetch and
        selective-gather passes, scheduled from the profile of those steps (deepspeed/compile/init_z3.py). Our
        Inductor settings apply as to every other whole-model graph (gpt2.runtime.compiling)."""
        apply_inductor_settings()
        sys.setrecursionlimit(max(sys.getrecursionlimit(), DEEPCOMPILE_RECURSION_LIMIT))
        log.info("DeepCompile: engine.compile(backend='inductor'); its ZeRO-3 passes replace the gather hooks")
        with arch_list_deepspeed_can_parse():  # engine.compile JIT-builds DeepSpeed's DeepCompile op
            self.engine.compile(backend="inductor")
        if not self.engine.is_deepcompile_active():  # DeepSpeed falls back to plain torch.compile with a log line
            raise ConfigError("DeepSpeed did not activate DeepCompile after engine.compile() (see its log above); "
                              "refusing to run plain torch.compile under --compiler deepcompile")

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, last_micro_step: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-step; DeepSpeed divides the loss by grad_accum and steps only at the boundary."""
        loss, correct = self.engine(x, y)
        self.engine.backward(self.guard.gate(loss))
        if not last_micro_step:
            self.engine.step()  # bookkeeping only: DeepSpeed counts micro-steps in step()
        return loss.detach(), correct.detach()

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step unless the global gradient norm is not finite, schedule (all inside DeepSpeed); returns the
        pre-clip global gradient norm (inf after a skipped step: DeepSpeed reports that)."""
        self._step_lr = self.scheduler.get_last_lr()[0]  # this update's lr; engine.step() schedules the next
        self.engine.step()
        if not self.engine.was_step_applied():  # DeepSpeed skipped it and kept the schedule: move on as TorchEngine
            self.scheduler.step()
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32, device=self.ctx.device)

    @property
    def lr(self) -> float:
        """The learning rate the last optimizer step used (logged with that step; before any step: the first's)."""
        return self._step_lr

    def evaluate(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """Mean loss and top-1 accuracy over `batches`, averaged over the data-parallel group."""
        self.engine.eval()
        with deepcompile_eval_settings(self.layout.deepcompile):
            result = evaluate_batches(self.engine, batches, self.ctx)
        self.engine.train()
        return result

    def save_state(self, folder: Path, step: int) -> None:
        """DeepSpeed's sharded checkpoint into folder/zero, the step in its client state (collective: every rank
        writes its shards); under --zero3-fetch flat, rank 0 also writes the flat tensors' layout (FLAT_LAYOUT_FILE)
        for export."""
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, client_state={"step": step}, save_latest=False)
        if self.layout.zero3_flat and self.ctx.is_main:
            save_layout(self.module, folder)

    def load_state(self, folder: Path) -> int | None:
        """Load model, optimizer and scheduler shards; returns the step the client state records."""
        path, client_state = self.engine.load_checkpoint(
            str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load the checkpoint in {folder / CHECKPOINT_TAG}")
        resync_lr(self.scheduler, self.cfg.train.lr)
        return client_state.get("step")
