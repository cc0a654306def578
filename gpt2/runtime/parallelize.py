"""Build this rank's model and apply the build order, for both engines (torchtitan's `parallelize_*` in one place).

    model = build_model(layout, device, dims, stats)        # full model from the seed, then --init-from weights
    parallelize(model, layout, dims, stats)                 # TP plan -> activation checkpointing -> compile
    # then the engine's own: DDP (+ a whole-model compile) or DeepSpeed's initialize, then the optimizer over
    param_groups(model, weight_decay)

The TP plan shards the existing full weights, so a TP model computes the single-device model's function from the
same seed. Under ZeRO-3 without TP and without --zero3-fetch flat (the default) the model is built inside
`deepspeed.zero.Init` (`zero3`): each module is partitioned over the data-parallel group as soon as its constructor
returns (see `gpt2.engines.deepspeed_engine`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fused_kernels import KernelOps, get_ops
from fused_kernels.attention import AttentionChoice, AttentionShape, resolve_attention
from gpt2.config.layout import RunLayout, inductor_compiles_head, torch_compiles_whole_model, whole_mlp_allowed
from gpt2.config.schema import RunConfig
from gpt2.model.gpt import GPT, Block, applies_weight_decay
from gpt2.observe.run_logging import log
from gpt2.runtime.block_units import BlockUnit, group_blocks
from gpt2.runtime.compiling import compile_forwards, compile_model
from gpt2.runtime.flat_blocks import DECAYS, FlatBlock, flatten_blocks
from parallel.comm import CommStats
from parallel.dims import ParallelDims
from parallel.mpu import ModelParallelUnit
from parallel.tp_plan import apply_tensor_parallel


def tp_comm_stats(layout: RunLayout) -> CommStats | None:
    """The byte counter of our TP collectives (the planner compares it with its prediction), or None where the
    layout does not count them (`RunLayout.counts_tp_comm`)."""
    return CommStats() if layout.counts_tp_comm else None


def kernel_ops(cfg: RunConfig) -> KernelOps:
    """The fused-kernel ops the model runs. The start-up check (`gpt2.engines.build.check_backends`) builds them
    through this function too, so it checks exactly what the model will use."""
    return get_ops(cfg.train.fused_kernels, inductor_head=inductor_compiles_head(cfg),
                   inductor_elementwise=torch_compiles_whole_model(cfg), whole_mlp=whole_mlp_allowed(cfg))


def build_model(layout: RunLayout, device: torch.device, dims: ParallelDims,
                zero3: tuple[Any, dict] | None = None) -> GPT:
    """This rank's full GPT-2 from the seed (identical on every rank), then the --init-from weights.

    `zero3`: (the deepspeed module, its config): build inside `deepspeed.zero.Init`, partitioned at construction;
    the seed draws the same values as the plain build (fp32), and --init-from is copied in one parameter at a time
    (rank 0 writes the full tensor, DeepSpeed re-partitions it)."""
    cfg = layout.cfg
    ops = kernel_ops(cfg)
    attention = choose_attention(layout, device)
    torch.manual_seed(cfg.train.seed)
    if zero3 is None:
        context: contextlib.AbstractContextManager = torch.device(device)
    else:
        deepspeed, ds_config = zero3
        context = deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=ModelParallelUnit(dims))
    with context:
        model = GPT(cfg.model, ops=ops, attention=attention.fn)
    model.attention_choice = attention  # for the run summary (gpt2.train.loop.build_summary)
    model.mlp_op = ops.mlp is not None  # the summary's `whole_mlp_op`: each MLP one fused op (fused_kernels.cuda.mlp)
    if cfg.train.init_from:
        from gpt2.model.hf_weights import load_hf_state_dict

        if zero3 is None:
            model.load_state_dict(load_hf_state_dict(cfg.train.init_from, cfg.model))
        else:
            deepspeed = zero3[0]
            sd = load_hf_state_dict(cfg.train.init_from, cfg.model) if dims.rank == 0 else None
            for name, p in model.named_parameters():
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                    if sd is not None:
                        p.copy_(sd[name])
    return model


def attention_shape(layout: RunLayout, device: torch.device) -> AttentionShape:
    """What this rank's attention sees in training: [batch, n_head / tp, seq_len, head_dim] (under sequence
    parallelism too: c_attn gathers the whole sequence) in the autocast dtype (fp32 without), with --dropout."""
    cfg = layout.cfg
    return AttentionShape(cfg.train.batch_size, cfg.model.n_head // layout.tp_size, cfg.train.seq_len,
                          cfg.model.head_dim, layout.autocast_dtype or torch.float32, torch.device(device),
                          cfg.model.dropout)


def choose_attention(layout: RunLayout, device: torch.device) -> AttentionChoice:
    """`--attn` resolved for this run's attention shape, logged. `auto` times its candidates on every rank, then
    every rank takes rank 0's choice (one kernel for the whole run, whatever the timing noise)."""
    choice = resolve_attention(layout.cfg.train.attn, attention_shape(layout, device))
    if choice.name == "auto" and dist.is_available() and dist.is_initialized():
        box = [choice.backend]
        dist.broadcast_object_list(box, src=0)
        choice = choice.with_backend(box[0])
    log.info("attention: %s", choice.describe())
    return choice


def parallelize(model: GPT, layout: RunLayout, dims: ParallelDims, stats: CommStats | None = None) -> GPT:
    """The build order up to the data-parallel wrapper, in place: the tensor-parallel plan (this rank keeps its
    shards; nothing to cut for tp 1) -> activation checkpointing -> block units (--zero3-unit-blocks' or
    --fsdp2-unit-blocks': `gpt2.runtime.block_units`) -> --zero3-fetch flat's or --fsdp2-params flat's flat block
    (or unit) tensors (`gpt2.runtime.flat_blocks`)
    -> ZeRO-3 leaf modules (one coalesced gather per block or unit, registered before
    DeepSpeed's hooks) -> torch.compile of each block (or unit) and the head (`--compile-scope
    blocks`; forwards only, hooks left eager, under ZeRO-3's leaf gathers). The engine adds DDP (then a
    `--compile-scope model` compile of the wrapped model) or DeepSpeed. `stats` counts the TP collectives' bytes."""
    cfg = layout.cfg
    apply_tensor_parallel(model, dims, sequence_parallel=layout.sequence_parallel,
                          overlap=cfg.parallel.tp_overlap, stats=stats)
    # GPT.forward checkpoints each entry of model.blocks, unless the units checkpoint their blocks themselves
    model.activation_checkpointing = cfg.train.activation_checkpointing and not layout.checkpoints_in_units
    unit_blocks = layout.block_unit_blocks  # DeepSpeed's leaf units or FSDP2's
    unit = "transformer block" if unit_blocks == 1 else f"unit of {unit_blocks} transformer blocks"  # for the logs
    if unit_blocks > 1:
        group_blocks(model, unit_blocks, checkpoint_layers=layout.checkpoints_in_units)
    if layout.flat_params:  # after the TP plan (its marks and layer types decide the groups)
        layout_of_block = flatten_blocks(model)
        log.info("%s flat parameters: %d tensors a %s (%s)", "FSDP2" if layout.fsdp2 else "ZeRO-3",
                 len(layout_of_block), unit, ", ".join(layout_of_block))
    if layout.zero3_blocks:  # before deepspeed.initialize, which registers the hooks: one per block instead of ~10
        from deepspeed.utils import set_z3_leaf_modules

        leaf = FlatBlock if layout.zero3_flat else BlockUnit if unit_blocks > 1 else Block
        leaves = set_z3_leaf_modules(model, [leaf])
        log.info("ZeRO-3 gathers parameters per %s (%d DeepSpeed leaf modules)", unit, len(leaves))
    if layout.compile_scope == "blocks":  # with ZeRO-3 only when blocks are leaves (config.validate)
        # forwards only where a ZeRO engine's gather hooks must stay eager (DeepSpeed leaf blocks, FSDP2 units)
        compile_parts = compile_forwards if layout.zero3_blocks or layout.fsdp2 else compile_model
        compile_parts(model, layout.inductor_cpp_wrapper)
    return model


def decays(p: nn.Parameter) -> bool:
    """`applies_weight_decay` by the parameter's full shape (a ZeRO-3 partition is 1-D: its shape is `ds_shape`); a
    flat tensor (--zero3-fetch flat, --fsdp2-params flat) carries its members' answer."""
    return getattr(p, DECAYS) if hasattr(p, DECAYS) else applies_weight_decay(getattr(p, "ds_shape", p.shape))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two groups: with weight decay (`decays`) and without."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()  # tied weights once
    decay = [p for p in params if decays(p)]
    no_decay = [p for p in params if not decays(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
