"""The tensor-parallel plan of GPT-2: which module becomes which parallel layer, declared once as data.

`PLAN` lists (module-name pattern, style) pairs; `apply_tensor_parallel` walks it in order, cuts each
matched module's EXISTING full weights into this rank's shard and swaps in the parallel layer. A model
built from the same seed therefore computes the same function before and after, on any TP size. The
same table drives `shard_state_dict` / `gather_state_dict` (checkpoint export, --init-from).

    module                  style        weight shard               under --sequence-parallel
    wte                     vocab        rows (vocab blocks)        reduce-scatter -> [B, T/tp, d]
    wpe                     position     replicated                 returns this rank's positions [T/tp, d]
    blocks.*.ln_1/ln_2, ln_f norm        replicated                 runs on shards; grads marked, see below
    blocks.*.attn.c_attn    column_qkv   rows of q, k, v each       all-gathers its input
    blocks.*.attn.c_proj    row          columns; bias replicated   reduce-scatters its output; bias marked
    blocks.*.mlp.c_fc       column       rows                       all-gathers its input
    blocks.*.mlp.c_proj     row          columns; bias replicated   reduce-scatters its output; bias marked
    lm_head                 lm_head      tied to wte's shard        all-gathers the sequence first

c_attn's fused output [q | k | v] is split block by block, so rank r holds whole heads
[r H/tp, (r+1) H/tp) of q, k and v and its local output is [q_r | k_r | v_r]; the attention module
derives its local head count from that width.

Sequence parallelism and gradients: a parameter used inside the sequence-sharded region (LayerNorm
weights/biases, row-parallel biases) is replicated but receives only its own tokens' gradient on each
rank. The plan marks it with `param.sequence_parallel = True`, and `parallel.grads` sums those
gradients over the TP group. Sharded parameters are marked `param.tensor_model_parallel = True`
(Megatron's name, which DeepSpeed reads), so gradient norms count them on every TP rank and the
replicated ones once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.comm import CommStats
from parallel.dims import ParallelDims
from parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceShardedEmbedding,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)


@dataclass(frozen=True)
class Shard:
    """How a full tensor splits over TP ranks: into contiguous chunks along `dim` (None: replicated).

    With `blocks` > 1 the tensor is `blocks` equal sub-blocks along `dim` (c_attn's [q | k | v]) and
    each sub-block is chunked separately; a rank's shard is the concatenation of its chunks.
    """

    dim: int | None
    blocks: int = 1


REPLICATED = Shard(None)
# the attributes the plan sets on a Parameter (read by DeepSpeed, parallel.grads and the engines that re-create
# Parameters: FSDP2's DTensors, --zero3-fetch flat's flat tensors)
PARAM_MARKS = ("tensor_model_parallel", "sequence_parallel")


def shard_tensor(full: torch.Tensor, spec: Shard, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of `full` (a fresh tensor, so the full one can be freed)."""
    if spec.dim is None:
        return full.detach().clone()
    blocks = full.chunk(spec.blocks, dim=spec.dim)
    return torch.cat([b.chunk(size, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).detach().clone()


def unshard_tensor(shards: list[torch.Tensor], spec: Shard) -> torch.Tensor:
    """Inverse of `shard_tensor`: the full tensor from every rank's shard, in rank order."""
    if spec.dim is None:
        return shards[0].clone()
    per_rank = [s.chunk(spec.blocks, dim=spec.dim) for s in shards]  # [rank][block]
    return torch.cat([per_rank[r][b] for b in range(spec.blocks) for r in range(len(shards))], dim=spec.dim)


@dataclass(frozen=True)
class _Context:
    model: nn.Module
    group: dist.ProcessGroup
    rank: int
    size: int
    sequence_parallel: bool
    overlap: bool
    stats: CommStats | None

    def shard(self, tensor: torch.Tensor, spec: Shard) -> torch.Tensor:
        return shard_tensor(tensor, spec, self.rank, self.size)


@dataclass(frozen=True)
class Style:
    """A parallel style: how each parameter of the module shards, and how to build its replacement.

    `build(module, params, ctx)` returns the new module, or the same one when it stays (after marking
    its parameters); `params` is this style's table, so the sharding is stated only here.
    """

    name: str
    params: dict[str, Shard]
    build: Callable[[nn.Module, dict[str, Shard], _Context], nn.Module]


def _mark_sequence_parallel(param: nn.Parameter, ctx: _Context) -> None:
    if ctx.sequence_parallel:
        param.sequence_parallel = True


def _vocab(m: nn.Module, params: dict[str, Shard], ctx: _Context) -> nn.Module:
    weight = ctx.shard(m.weight, params["weight"])  # [V/tp, d]
    return VocabParallelEmbedding(weight, ctx.rank * weight.shape[0], ctx.group,
                                  sequence_parallel=ctx.sequence_parallel, stats=ctx.stats)


def _position(m: nn.Module, params: dict[str, Shard], ctx: _Context) -> nn.Module:
    if not ctx.sequence_parallel:
        return m
    return SequenceShardedEmbedding(ctx.shard(m.weight, params["weight"]), ctx.group, ctx.stats)


def _norm(m: nn.Module, params: dict[str, Shard], ctx: _Context) -> nn.Module:
    for p in m.parameters():
        _mark_sequence_parallel(p, ctx)
    return m


def _column(m: nn.Module, params: dict[str, Shard], ctx: _Context) -> nn.Module:
    return ColumnParallelLinear(ctx.shard(m.weight, params["weight"]), ctx.shard(m.bias, params["bias"]), m.ops,
                                ctx.group, sequence_parallel=ctx.sequence_parallel, overlap=ctx.overlap,
                                stats=ctx.stats)


def _row(m: nn.Module, params: dict[str, Shard], ctx: _Context) -> nn.Module:
    layer = RowParallelLinear(ctx.shard(m.weight, params["weight"]), ctx.shard(m.bias, params["bias"]), m.ops,
                              ctx.group, sequence_parallel=ctx.sequence_parallel, stats=ctx.stats)
    _mark_sequence_parallel(layer.bias, ctx)
    return layer


def _lm_head(m: nn.Module, params: dict[str, Shard], ctx: _Context) -> nn.Module:
    wte = ctx.model.wte  # already vocab-parallel: the plan shards wte first, and the head is tied to it
    if not isinstance(wte, VocabParallelEmbedding):
        raise TypeError("the TP plan must shard `wte` before `lm_head` (they share one weight)")
    return VocabParallelLMHead(wte.weight, wte.vocab_start, m.vocab_size, m.ops, ctx.group,
                               sequence_parallel=ctx.sequence_parallel, overlap=ctx.overlap, stats=ctx.stats)


VOCAB = Style("vocab", {"weight": Shard(0)}, _vocab)
POSITION = Style("position", {"weight": REPLICATED}, _position)
NORM = Style("norm", {"weight": REPLICATED, "bias": REPLICATED}, _norm)
COLUMN_QKV = Style("column_qkv", {"weight": Shard(0, blocks=3), "bias": Shard(0, blocks=3)}, _column)
COLUMN = Style("column", {"weight": Shard(0), "bias": Shard(0)}, _column)
ROW = Style("row", {"weight": Shard(1), "bias": REPLICATED}, _row)
LM_HEAD = Style("lm_head", {"weight": Shard(0)}, _lm_head)

# Applied top to bottom; every pattern must match at least one module of gpt2.model.gpt.GPT.
PLAN: tuple[tuple[str, Style], ...] = (
    ("wte", VOCAB),
    ("wpe", POSITION),
    ("blocks.*.ln_1", NORM),
    ("blocks.*.attn.c_attn", COLUMN_QKV),
    ("blocks.*.attn.c_proj", ROW),
    ("blocks.*.ln_2", NORM),
    ("blocks.*.mlp.c_fc", COLUMN),
    ("blocks.*.mlp.c_proj", ROW),
    ("ln_f", NORM),
    ("lm_head", LM_HEAD),
)


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, *, sequence_parallel: bool, overlap: bool,
                          stats: CommStats | None = None) -> None:
    """Swap GPT-2's modules for their tensor-parallel versions in place, sharding the current full weights.

    Call on every rank of the TP group, after building the model with the same seed (or loading the same
    full weights) everywhere and before activation checkpointing, compile and data parallelism. A no-op
    for tp_size 1. `stats` (optional) receives the byte counts of every TP collective the model runs.
    """
    if dims.tp_size == 1:
        return
    if model.cfg.n_head % dims.tp_size:  # the user-facing check, naming the fix, is gpt2.config.layout's
        raise ValueError(f"n_head {model.cfg.n_head} is not a multiple of tp_size {dims.tp_size}")
    if dims.tp_group is None:
        raise ValueError("ParallelDims has no TP group yet; call dims.build_groups() on every rank first")
    ctx = _Context(model, dims.tp_group, dims.tp_rank, dims.tp_size, sequence_parallel, overlap, stats)
    for pattern, style in PLAN:
        names = [name for name, _ in model.named_modules() if fnmatchcase(name, pattern)]
        if not names:
            raise ValueError(f"TP plan pattern {pattern!r} matches no module of {type(model).__name__}")
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            new = style.build(getattr(parent, child), style.params, ctx)
            setattr(parent, child, new)
            for param_name, spec in style.params.items():
                if spec.dim is not None:
                    getattr(new, param_name).tensor_model_parallel = True


def param_shard(name: str) -> Shard:
    """The Shard of a state-dict key of the GPT-2 model, e.g. 'blocks.3.attn.c_attn.weight'."""
    module, _, param = name.rpartition(".")
    for pattern, style in PLAN:
        if fnmatchcase(module, pattern) and param in style.params:
            return style.params[param]
    raise KeyError(f"{name!r} is not covered by the TP plan; add its module to parallel.tp_plan.PLAN")


def shard_state_dict(full: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """A full (single-device) GPT-2 state dict cut into rank `tp_rank`'s TP layout; no communication."""
    return {k: shard_tensor(v, param_shard(k), tp_rank, tp_size) for k, v in full.items()}


def gather_state_dict(model: nn.Module, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """The full state dict of a TP model (collective over the TP group; every TP rank gets it)."""
    state = model.state_dict()
    if dims.tp_size == 1:
        return {k: v.detach().clone() for k, v in state.items()}
    full = {}
    for key, local in state.items():
        spec = param_shard(key)
        if spec.dim is None:
            full[key] = local.detach().clone()
            continue
        shards = [torch.empty_like(local) for _ in range(dims.tp_size)]
        dist.all_gather(shards, local.detach().contiguous(), group=dims.tp_group)
        full[key] = unshard_tensor(shards, spec)
    return full
