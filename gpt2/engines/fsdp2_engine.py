"""`--mode hybrid --zero-engine fsdp2`: ZeRO by PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) behind the
engine interface, beside DeepSpeed's (`gpt2.engines.deepspeed_engine`, the default).

    torchrun --nproc_per_node=4 train.py --mode hybrid --zero-engine fsdp2                 # ZeRO-3 by FSDP2
    deepspeed --num_gpus=4 train.py --mode hybrid --zero-engine fsdp2 --tp-size 2 --compile  # + our TP, per unit

Sharding. Each group of --fsdp2-unit-blocks consecutive transformer blocks (`RunLayout.fsdp2_unit_blocks`: 4, or
over flat tensors the largest divisor of the blocks up to 4; over its own tensors the last unit takes what is left)
is one module, a `BlockUnit` (`gpt2.runtime.block_units`, grouped by `gpt2.runtime.parallelize` as DeepSpeed's leaf
units are: `RunLayout.block_unit_blocks`), and one `fully_shard` unit (one all-gather of its parameters before its
forward and again before its backward, one reduce-scatter of its gradients, one set of hooks). At batch 8 the step
is host-bound, and FSDP2's host work is per unit, so fewer, larger units step faster (docs/decisions.md); a unit
that is one module is also one compiled graph (below). The root module is the last unit: the token and position
embeddings, the final LayerNorm and the LM head, whose weight IS `wte.weight` (GPT-2 ties them; `LMHead`
registers the same Parameter), so the tie lives inside one unit: FSDP2 shards it once, swaps the gathered tensor
into both modules and accumulates both gradient contributions before its reduce-scatter. The root stays gathered
from its forward to its backward (`reshard_after_forward=False`: the head runs last in forward, first in backward;
resharding it would gather the largest unit twice a micro-step). The mesh is a 1-D
DeviceMesh over this rank's data-parallel group (`DeviceMesh.from_group(dims.dp_group)`: the existing group, no
new communicator). With --tp-size N the TP groups are consecutive ranks and the DP groups strided
(`parallel.dims`: world 4, tp 2 -> DP groups [0, 2] and [1, 3]): our TP plan runs first and leaves each rank its
TP shard as a plain tensor; FSDP2 then shards that shard over the DP group (dim 0), so a weight is split tp x dp
ways, as under DeepSpeed with the mpu. Both TP ranks of a DP position hold the same FSDP2 layout.

--fsdp2-params flat (the default): each unit's parameters are first moved into 3-4 flat tensors
(`gpt2.runtime.flat_blocks`'s FlatBlock around the unit, DeepSpeed's --zero3-fetch flat layout: grouped by Linear or
not, weight decay and the TP plan's marks), so FSDP2 shards, gathers and hooks a few tensors a unit instead of 12 a
block. FSDP2's host work is per parameter (a DTensor each, the swap of sharded and unsharded tensors into their
modules, the copy in and out of the all-gather buffer), so a flat unit costs less host time; the values are the
members', the forward runs the same blocks on views of them. --fsdp2-params tensors leaves each parameter its own
FSDP2 tensor.

--zero-stage (FSDP2's `reshard_after_forward`):
- 3 (default): True. Parameters are freed after each unit's forward and gathered again for its backward:
  ZeRO-3's memory and traffic (2 all-gathers + 1 reduce-scatter of the weights a step).
- 2: False. Each unit's parameters stay gathered from its forward until its backward has used them, then are
  freed: one all-gather + one reduce-scatter a step, DeepSpeed ZeRO-2's traffic; the whole (TP-local) model is
  held gathered at the end of forward, as ZeRO-2 holds it always, but between steps only the shards stay (less
  than ZeRO-2 outside forward/backward). Gradients and optimizer states are sharded, as in ZeRO-2.
- 1: refused at the command line (gpt2.config.cli.check_zero_engine): FSDP2 always shards gradients.

Precision (--fsdp2-gather, `RunLayout.fsdp2_gather_dtype`; `mixed_precision`): single's recipe, torch.autocast
over fp32 master weights. The sharded parameters are fp32 (master weights and optimizer states), the forward runs
under torch.autocast in the run's dtype (bf16 on GPU; CPU runs are fp32, no autocast), and gradients are fp32,
reduce-scattered in fp32 and averaged over the DP group (FSDP2 divides by its size; the loss is divided by
--grad-accum, as TorchEngine does). What is gathered:
- bf16 (auto's choice for bf16 runs without fused kernels): the block units gather their weights in bf16
  (`param_dtype=bf16`), which is what autocast would cast each Linear weight and bias to before its matmul, so the
  matmuls see the same values, with half the all-gather bytes and no autocast weight copies; the LayerNorm scales
  and biases are rounded to bf16 too (LayerNorm still computes in fp32: autocast upcasts them), and so are their
  gradients; under TP, RowParallelLinear adds its bias in bf16. Those are the differences from single's function,
  within the parity gate (docs/decisions.md). Inputs are not cast
  (`cast_forward_inputs=False`): the residual stream stays fp32, as under autocast. The root (embeddings, tied
  head, final LayerNorm) gathers fp32: the embedding output is the residual stream. Gradients come out of the
  blocks in bf16 (for the Linears no change: autocast's matmul gradients are bf16 before their cast to fp32) and
  are cast to fp32 before the reduce-scatter. DeepSpeed's torch_autocast does likewise for Linear weights and also
  reduces their gradients in 16 bits.
- fp32: every unit gathers fp32 and autocast casts in each forward: single's function to the bit.
A bf16 policy on the root too would cast the residual stream to bf16: another function, as DeepSpeed's own 16-bit
model is (--zero-precision deepspeed), so it is not offered.

The step: fused AdamW over the sharded DTensor parameters (`parallelize.param_groups`: the same groups and weight
decay as every engine) run on their local shards (`LocalShardAdamW`; with --optimizer triton the Triton AdamW on the
same shards), the LambdaLR schedule, TP-aware clipping (`parallel.grads.grad_norm`: local sums of squares, one
all-reduce over DP x TP; replicated ones counted once; the fused AdamW divides the gradients by the clip divisor as
it reads them), the non-finite guard (`step_if_finite`: the fused AdamW skips the step on the device when the global
norm is not finite). Gradient accumulation: `set_requires_gradient_sync(False)` on every micro-step but the last
(FSDP2 keeps the unsharded gradients and reduce-scatters their sum once). --sequence-parallel: the marked
parameters' gradients are summed over the TP group after the last micro-step's reduce-scatter, on this rank's DP
shard (both TP ranks of a DP position hold the same shard of a replicated parameter; sums commute with the DP
average). --compile compiles each unit's (and the final LayerNorm's and LM head's) forward before `fully_shard`
(`gpt2.runtime.compiling.compile_forwards`): one graph a unit and pass, not one a block, so the per-graph host costs
(guards, the compiled function's wrappers) are paid once a unit, as FSDP2's hooks are; the hooks stay eager, outside
the graphs (launch code in C++ where --compile-wrapper auto says: on CUDA at ZeRO-3 without sequence parallelism or
fused kernels). --activation-checkpointing under --fsdp2-params tensors checkpoints each block inside its unit
(`RunLayout.checkpoints_in_units`: backward recomputes one block at a time, as it did before units were modules; under
--compile the checkpoints are traced into the unit's graph, which AOTAutograd's partitioner recomputes block by
block); over flat tensors GPT.forward checkpoints each unit whole, as DeepSpeed's leaf units (a block's recompute
would run outside its unit's views of the flat tensors).

Checkpoints (through `save_state`/`load_state`, so `gpt2.train.checkpoint`'s kill-safe folder protocol, manifest
and resume apply unchanged): under --fsdp2-params tensors, under the blocks' own parameter names (`blocks.N.<name>`:
the units' names are mapped by `renamed` on save and load), so such a checkpoint resumes at any
--fsdp2-unit-blocks, checkpoints from before units were modules included. `torch.distributed.checkpoint` writes the
model and optimizer state sharded, one DCP folder per TP rank, `fsdp2/tp00`, `fsdp2/tp01`, ..., each by that TP rank's
DP group (its ranks' shards, the same keys on every TP rank: one folder for them all would merge different tensors under
one name), and rank 0 writes `fsdp2/schedule.pt` (LR schedule and step, weights_only). `python -m gpt2.train.export`
reads the folders on the CPU without a process group (`read_model_state`) and joins the TP shards by the TP plan. Under
--fsdp2-params flat the checkpoint holds each unit's flat tensors (`blocks.U.matmul.decay_tp`), so it resumes only with
the same --fsdp2-params and --fsdp2-unit-blocks (gpt2.train.checkpoint says so), and rank 0 writes their layout beside
them (FLAT_LAYOUT_FILE), by which export splits them back into the blocks' names.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gpt2.config.layout import RunLayout
from gpt2.engines.base import resync_lr
from gpt2.engines.torch_engine import TorchEngine
from gpt2.model.gpt import GPT
from gpt2.observe.run_logging import log
from gpt2.runtime.block_units import block_key
from gpt2.runtime.distributed import DistContext
from gpt2.runtime.flat_blocks import DECAYS, save_layout
from parallel.grads import grad_norm, local_shard
from parallel.tp_plan import PARAM_MARKS

FSDP2_DIR = "fsdp2"  # the engine's sub-folder inside one of our step folders (gpt2.train.checkpoint)
SCHEDULE_FILE = "schedule.pt"
MODEL_KEY, OPTIM_KEY = "model", "optimizer"


def tp_dir(folder: Path, tp_rank: int) -> Path:
    """The DCP folder of one TP rank inside a step folder."""
    return folder / FSDP2_DIR / f"tp{tp_rank:02d}"


def dp_mesh(ctx: DistContext) -> DeviceMesh:
    """A 1-D DeviceMesh over this rank's data-parallel group (strided ranks under TP), reusing the group."""
    return DeviceMesh.from_group(ctx.dims.dp_group, ctx.device.type)


def mixed_precision(gather_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """Parameters gathered in `gather_dtype` (None: their own fp32), gradients reduced in fp32, inputs left as they
    come (the fp32 residual stream); compute precision comes from torch.autocast."""
    return MixedPrecisionPolicy(param_dtype=gather_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_model(model: GPT, mesh: DeviceMesh, *, reshard_after_forward: bool,
                block_gather_dtype: torch.dtype | None = None, forward_prefetch: int = 0) -> list[nn.Module]:
    """`fully_shard` each entry of `model.blocks` (a BlockUnit of --fsdp2-unit-blocks blocks, grouped by
    `gpt2.runtime.parallelize`, or a block, either inside a FlatBlock under --fsdp2-params flat; `reshard_after_forward`
    as --zero-stage says; one FSDP2 unit: one all-gather, one reduce-scatter, one set of hooks; weights gathered in
    `block_gather_dtype`, None: fp32), then the root (embeddings, final LayerNorm, tied LM head; gathered fp32, never
    resharded after forward), in place; the TP plan's marks (and a flat tensor's weight-decay answer) move to the new
    DTensor parameters; each unit's forward prefetches the next `forward_prefetch` block units (set_forward_prefetch).
    Returns the units, root last."""
    # fully_shard replaces every Parameter by a DTensor one, so the marks are carried over by name
    marks = {name: {m: getattr(p, m) for m in (*PARAM_MARKS, DECAYS) if hasattr(p, m)}
             for name, p in model.named_parameters()}
    for unit in model.blocks:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mixed_precision(block_gather_dtype))
    # the root stays gathered from forward to backward at either stage: its LM head runs last in forward and first
    # in backward (an explicit True would free it there and gather it again: twice its all-gather bytes)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mixed_precision(None))
    units: list[nn.Module] = [*model.blocks, model]
    for name, p in model.named_parameters():
        for mark, value in marks.get(name, {}).items():
            setattr(p, mark, value)
    set_forward_prefetch(units, forward_prefetch)
    return units


def set_forward_prefetch(units: list[nn.Module], depth: int) -> None:
    """Each unit's forward (the root's first: it runs the embeddings before block 0) issues the all-gathers of the
    next `depth` block units (`units`: shard_model's, root last; 0 leaves FSDP2's default, no forward prefetch).
    Without it a unit's all-gather is issued by its own pre-forward hook, so it overlaps the previous unit's
    compute only when the host runs ahead of the device, which at batch 8 it barely does; yet depth 1 did not
    speed that step up (docs/decisions.md), so the default is 0. Prefetching holds at most `depth` more units
    gathered during forward, below the peak at backward's start (gpt2.planning.planner.fsdp2_memory)."""
    *blocks, root = units
    if depth == 0 or not blocks:
        return
    for i, unit in enumerate([root, *blocks]):  # the root is followed by blocks[0], blocks[i - 1] by blocks[i]
        unit.set_modules_to_forward_prefetch(blocks[i:i + depth])


class _Counted:
    """An FSDP2 collective (its default all-gather or reduce-scatter) that adds the full tensor's bytes to `counts`."""

    def __init__(self, inner: Any, kind: str, counts: Counter, full: str):
        self.inner, self.kind, self.counts, self.full = inner, kind, counts, full

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        full = output_tensor if self.full == "output" else input_tensor
        self.counts[self.kind] += full.numel() * full.element_size()
        return self.inner(output_tensor, input_tensor, *args, **kwargs)


class FSDP2CommLog:
    """`--comm-log` under FSDP2: bytes per collective kind of the units' all-gathers and reduce-scatters, in
    CommStats' convention (the full, unsharded tensor of each collective: an all-gather's output, a reduce-scatter's
    input, FSDP2's padding of the shards to equal sizes included), counted by wrapping FSDP2's default collectives
    (`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`; only under --comm-log). The interface of
    `gpt2.engines.deepspeed_engine.ZeroCommLog`, which `gpt2.observe.metrics.TrainingCommMeter` reads."""

    def __init__(self, units: list[nn.Module]):
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        self.counts: Counter = Counter()
        for unit in units:
            unit.set_custom_all_gather(_Counted(DefaultAllGather(), "all_gather", self.counts, "output"))
            unit.set_custom_reduce_scatter(_Counted(DefaultReduceScatter(), "reduce_scatter", self.counts, "input"))

    def reset(self) -> None:
        self.counts.clear()

    def bytes_by_collective(self) -> dict[str, float]:
        return {kind: float(n) for kind, n in self.counts.items()}


class LocalShardAdamW(torch.optim.AdamW):
    """torch's fused AdamW whose update runs on each DTensor's local shard: the same kernels on the same numbers
    (AdamW is elementwise, so the shard's update is the DTensor's), without DTensor's per-op dispatch over FSDP2's
    hundreds of sharded parameters (pytorch/pytorch#134191: host time a step that grows with the parameter count,
    though a device-bound step hides it: docs/decisions.md). The parameters and the state stay DTensors
    (`get_state_dict`/DCP see what they saw): only the lists `Adam.step` hands its kernel hold their local tensors
    (views of the same storage, so the update lands in place). `_init_group` has this signature in every torch the
    harness supports (2.11-2.13); tests/unit/test_fsdp2_step.py checks the step against AdamW on DTensors."""

    def _init_group(self, group: dict, *tensor_lists: list[torch.Tensor]) -> bool:
        has_complex = super()._init_group(group, *tensor_lists)
        for tensors in tensor_lists:  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
            tensors[:] = [local_shard(t) for t in tensors]
        return has_complex


class FSDP2Engine(TorchEngine):
    """ZeRO-2/3 by FSDP2 with our TP inside: TorchEngine's step (autocast, fused AdamW over `param_groups`, the
    schedule, the guard, evaluation) with FSDP2's sharding where DDP would wrap; `module` is our GPT (its units
    FSDPModules)."""

    def optimizer_factory(self) -> Callable[..., torch.optim.AdamW]:
        """LocalShardAdamW, or with --optimizer triton the Triton AdamW on the same local shards."""
        if self.layout.triton_adamw:
            from fused_kernels.triton.adamw import TritonAdamW

            return functools.partial(TritonAdamW, shard=local_shard)
        return LocalShardAdamW

    def __init__(self, layout: RunLayout, ctx: DistContext):
        super().__init__(layout, ctx)  # TP plan -> act. checkpointing -> compiled forwards -> wrap: fully_shard
        self.zero_comm_log = FSDP2CommLog(self.units) if layout.cfg.parallel.comm_log else None

    def wrap(self, model: nn.Module) -> nn.Module:
        """fully_shard the blocks and the root over the DP group (before the optimizer is built over the shards)."""
        layout, dims = self.layout, self.ctx.dims
        reshard = layout.zero_stage == 3
        unit_blocks = layout.block_unit_blocks  # model.blocks holds the units (gpt2.runtime.parallelize)
        prefetch = layout.cfg.parallel.fsdp2_forward_prefetch
        self.units = shard_model(model, dp_mesh(self.ctx), reshard_after_forward=reshard,
                                 block_gather_dtype=layout.fsdp2_gather_dtype, forward_prefetch=prefetch)
        self.gradient_sync: bool = True  # what every unit's set_requires_gradient_sync says (FSDP2's default: True)
        log.info("FSDP2: %d units (transformer blocks in units of at most %d, + embeddings/head) sharded over the "
                 "data-parallel group of %d (reshard_after_forward=%s: ZeRO-%d), fp32 parameters, blocks gathered in "
                 "%s, fp32 gradient reduction, autocast %s, forward prefetch of %d units",
                 len(self.units), unit_blocks, dims.dp_size, reshard, layout.zero_stage,
                 layout.fsdp2_gather, layout.autocast_dtype or "off", prefetch)
        return model

    def no_sync(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduce-scattered only on the step's last micro-step (FSDP2 accumulates them unsharded). Set
        on each unit alone, and only when it changes: the root's recursive call walks every submodule of the model
        on every micro-step."""
        if last_micro_step != self.gradient_sync:
            for unit in self.units:
                unit.set_requires_gradient_sync(last_micro_step, recurse=False)
            self.gradient_sync = last_micro_step
        return contextlib.nullcontext()

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The global norm of the DTensor gradients: reduced over DP, the TP-sharded ones' squares over TP."""
        return grad_norm(params, self.ctx.dims)

    def evaluate(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """TorchEngine's evaluation, then every unit back to its shards: a forward without backward leaves the units
        that are not resharded after forward (the root; every block at --zero-stage 2) gathered."""
        result = super().evaluate(batches)
        for unit in self.units:
            unit.reshard()
        return result

    def _state(self) -> dict[str, Any]:
        """The model and optimizer state under the blocks' own parameter names (`blocks.N.<name>`, not the units'
        `blocks.U.layers.J.<name>`): over their own tensors a checkpoint does not depend on --fsdp2-unit-blocks (nor
        on whether the blocks were grouped into modules when it was saved), and export reads plain GPT names; a flat
        unit's tensors (`blocks.U.matmul.decay`) keep their unit's name."""
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return renamed({MODEL_KEY: model_sd, OPTIM_KEY: optim_sd},
                       lambda key: block_key(key, self.layout.block_unit_blocks))

    def save_state(self, folder: Path, step: int) -> None:
        """Model and optimizer shards by torch.distributed.checkpoint into folder/fsdp2/tpXX (each TP rank's DP
        group writes its own), the schedule and step by rank 0 (collective); under --fsdp2-params flat, rank 0 also
        writes the flat tensors' layout (FLAT_LAYOUT_FILE) for export."""
        dims = self.ctx.dims
        dcp.save(self._state(), checkpoint_id=tp_dir(folder, dims.tp_rank), process_group=dims.dp_group)
        if self.ctx.is_main:
            torch.save({"scheduler": self.scheduler.state_dict(), "step": step}, folder / FSDP2_DIR / SCHEDULE_FILE)
            if self.layout.fsdp2_flat:
                save_layout(self.module, folder)

    def load_state(self, folder: Path) -> int | None:
        """Load this TP rank's shards into the model and optimizer, the schedule; returns the step it records."""
        dims = self.ctx.dims
        state = self._state()
        dcp.load(state, checkpoint_id=tp_dir(folder, dims.tp_rank), process_group=dims.dp_group)
        own = {block_key(name, self.layout.block_unit_blocks): name for name, _ in self.module.named_parameters()}
        state = renamed(state, lambda key: own.get(key, key))  # back to the module's names (units') for set_state_dict
        set_state_dict(self.module, self.optimizer, model_state_dict=state[MODEL_KEY],
                       optim_state_dict=state[OPTIM_KEY])
        saved = torch.load(folder / FSDP2_DIR / SCHEDULE_FILE, map_location="cpu", weights_only=True)
        self.scheduler.load_state_dict(saved["scheduler"])
        resync_lr(self.scheduler, self.cfg.train.lr)
        return saved["step"]


def renamed(state: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """`get_state_dict`'s model and optimizer state dicts ({MODEL_KEY: ..., OPTIM_KEY: ...}) with every parameter
    name mapped by `name`: the model's keys, the optimizer's per-parameter state keys and its param_groups' lists
    of names (get_state_dict keys the optimizer by parameter name too). The values are the same objects."""
    optim_sd = state[OPTIM_KEY]
    return {MODEL_KEY: {name(key): value for key, value in state[MODEL_KEY].items()},
            OPTIM_KEY: {**optim_sd, "state": {name(key): value for key, value in optim_sd["state"].items()},
                        "param_groups": [{**group, "params": [name(key) for key in group["params"]]}
                                         for group in optim_sd["param_groups"]]}}


def read_model_state(step_dir: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    """One TP rank's full (DP-gathered) fp32 model state dict from an fsdp2 checkpoint, on the CPU and without a
    process group (for `gpt2.train.export`): tensors of the shapes DCP's metadata records, filled by `dcp.load`."""
    path = tp_dir(step_dir, tp_rank)
    metadata = dcp.FileSystemReader(path).read_metadata()
    prefix = MODEL_KEY + "."
    state = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, dcp.metadata.TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({MODEL_KEY: state}, checkpoint_id=path, no_dist=True)
    return state

