"""`--zero3-fetch flat` and `--fsdp2-params flat`: each transformer block's (or unit's) parameters in a few flat
tensors, so that DeepSpeed ZeRO-3 or FSDP2 handles 3-4 tensors a unit instead of 12 a block. The text below is
DeepSpeed's case; FSDP2's is the same layout under `fully_shard` (gpt2.engines.fsdp2_engine).

ZeRO-3's host work is per parameter tensor: fetch and release bookkeeping, a gradient hook, a reduce-scatter slot
and a partition per tensor, each step. GPT-2 Large has 436 tensors; flattened, 112 (tp 1) or 148 (TP). Fewer
tensors cut the step's host time with the same losses to the bit (the CPU prototype,
benchmarks/repro/deepspeed_flat_block_params.py; docs/decisions.md).

    FlatBlock(block)          # the block's 12 Parameters -> one flat Parameter per FlatGroup, views in forward
      .matmul.<group>         # the MATMUL_TYPES' weights / biases: a MatmulFlatParams, which DeepSpeed gathers
                              #   and reduces in the autocast dtype (LOWER_PRECISION_MODULES of
                              #   gpt2.config.deepspeed_file),
                              #   as it does a Linear's own parameters
      .other.<group>          # LayerNorm gains and biases: fp32, as before
      .block                  # the original Block, its Parameters removed; run through functional_call on views
                              #   (a plain attribute, not a submodule: module-tree walks skip its modules)

A group is the set of a block's parameters that ZeRO treats alike: whether a Linear owns them (communication dtype),
whether AdamW decays them (`applies_weight_decay`), and the TP plan's marks (`tensor_model_parallel`: sharded over
TP, so norms count it on every TP rank; `sequence_parallel`: its gradient is summed over TP). Each flat tensor
carries its members' marks and `decays`, so the engine's parameter groups, DeepSpeed's norms and the SP gradient
hooks see what they saw on the members.

Same function: the flat tensors are the members' values, concatenated in `named_parameters` order, and the forward
runs the same Block on views of them; autograd's view backward hands each member's gradient to its slice. A view that
autograd saves for backward keeps its block's gathered storage alive until the block's backward (a Parameter saved as
itself does not: ZeRO-3 empties its `.data` after the forward); a unit's weights are gathered until its backward
anyway (DeepSpeed keeps them: gpt2.planning.planner), so the peak is per-block ZeRO-3's (docs/decisions.md).

Built on whole tensors (after the TP plan, before `deepspeed.initialize`), so not under `deepspeed.zero.Init`: the
model exists whole on every device until DeepSpeed partitions it, as it does under TP (GPT-2 XL: 6 GB of fp32).

Checkpoints hold the flat names (`blocks.N.matmul.decay_tp`); `layout()` lists each flat tensor's members with their
(TP-local) shapes, the engine writes it beside DeepSpeed's files, and `unflatten_state_dict` restores our names for
export (`gpt2.train.export`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.func import functional_call

from gpt2.model.gpt import Linear, applies_weight_decay
from parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel.tp_plan import PARAM_MARKS

FLAT_LAYOUT_FILE = "flat_blocks.json"  # a checkpoint step folder's `layout()`: save_layout, read_layout
DECAYS = "decays"  # a flat tensor's weight-decay answer, read by gpt2.runtime.parallelize.param_groups
Layout = dict[str, list[tuple[str, list[int]]]]  # flat tensor path in a block -> [(member name, member shape)]
# every matmul module, before and after the TP plan: ZeRO gathers and reduces their weights in the autocast dtype
# (autocast would cast them to 16 bits anyway), not the embeddings' or LayerNorms', which compute in fp32
MATMUL_TYPES: tuple[type, ...] = (Linear, ColumnParallelLinear, RowParallelLinear)


@dataclass(frozen=True)
class FlatGroup:
    """What ZeRO must treat alike in one flat tensor."""

    matmul: bool  # owned by a Linear: gathered and reduced in the autocast dtype
    decays: bool
    marks: tuple[str, ...]  # the PARAM_MARKS set on every member

    @property
    def name(self) -> str:
        """The flat tensor's attribute name: `decay`, `no_decay`, with `_tp` / `_sp` for the marks."""
        suffix = "".join(f"_{'tp' if mark == 'tensor_model_parallel' else 'sp'}" for mark in self.marks)
        return ("decay" if self.decays else "no_decay") + suffix


def group_of(block: nn.Module, name: str, param: nn.Parameter) -> FlatGroup:
    owner = block.get_submodule(name.rpartition(".")[0])
    return FlatGroup(matmul=isinstance(owner, MATMUL_TYPES), decays=applies_weight_decay(param.shape),
                     marks=tuple(m for m in PARAM_MARKS if getattr(param, m, False)))


class FlatParams(nn.Module):
    """Holds a block's fp32-gathered flat tensors (LayerNorm parameters)."""


class MatmulFlatParams(FlatParams):
    """Holds a block's flat Linear parameters; DeepSpeed's torch_autocast lists this class as lower-precision safe."""


class FlatBlock(nn.Module):
    """`block` (a Block, or a BlockUnit of several: --zero3-unit-blocks, --fsdp2-unit-blocks) with its Parameters
    moved into one flat Parameter per FlatGroup (see the module docstring)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        members: dict[FlatGroup, list[tuple[str, nn.Parameter]]] = {}
        for name, param in block.named_parameters():
            members.setdefault(group_of(block, name, param), []).append((name, param))
        self.matmul, self.other = MatmulFlatParams(), FlatParams()
        self.members: dict[str, list[tuple[str, torch.Size]]] = {}  # flat path -> [(member, shape)], in cat order
        for group, named in members.items():
            with torch.no_grad():
                flat = nn.Parameter(torch.cat([p.reshape(-1) for _, p in named]))  # [sum of the members' numel]
            setattr(flat, DECAYS, group.decays)
            for mark in group.marks:
                setattr(flat, mark, True)
            holder = "matmul" if group.matmul else "other"
            self.get_submodule(holder).register_parameter(group.name, flat)
            self.members[f"{holder}.{group.name}"] = [(n, p.shape) for n, p in named]
        for name, _ in block.named_parameters():  # None, not kept: DeepSpeed would partition them too
            owner, _, attr = name.rpartition(".")
            block.get_submodule(owner).register_parameter(attr, None)
        if any(True for _ in block.buffers()):  # .to() and state_dict would not see them: see below
            raise ValueError(f"{type(block).__name__} holds buffers; FlatBlock keeps no tensor outside its flat ones")
        # A plain attribute, not a submodule: it now holds no Parameter or buffer, so state_dict, .to() and the
        # optimizer lose nothing, and walks of the module tree (nn.Module.named_parameters, modules()) skip its
        # modules. DeepSpeed's ZeRO-3 walks each leaf module several times a pass (fetch, release, forward and
        # backward) and the whole model at every forward's start and end and at every optimizer step: with the
        # blocks' modules in the tree those walks visit every module of every block each time, host work the flat
        # tensors do not need (docs/decisions.md). `train` reaches it.
        object.__setattr__(self, "block", block)

    def train(self, mode: bool = True) -> FlatBlock:
        """nn.Module's, and `block` too: it is not a registered submodule (see __init__), so nn.Module.train would not
        reach its dropouts and attention."""
        super().train(mode)
        self.block.train(mode)
        return self

    def views(self) -> dict[str, torch.Tensor]:
        """Each member's name -> a view of its slice of the (gathered) flat tensor, in its own shape."""
        out: dict[str, torch.Tensor] = {}
        for path, named in self.members.items():
            pieces = self.get_parameter(path).split([shape.numel() for _, shape in named])  # 1-D views
            out.update({name: piece.view(shape) for (name, shape), piece in zip(named, pieces)})
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.block, self.views(), (x,))  # [B, T, d] -> [B, T, d]

    def layout(self) -> Layout:
        return {path: [(name, list(shape)) for name, shape in named] for path, named in self.members.items()}


def flatten_blocks(model: nn.Module) -> Layout:
    """Replace each of `model.blocks` by a FlatBlock around it, in place (after the TP plan, which sets the marks and
    the layer types); returns the layout, the same for every block."""
    model.blocks = nn.ModuleList(FlatBlock(block) for block in model.blocks)
    return model.blocks[0].layout()


def save_layout(model: nn.Module, step_dir: Path) -> None:
    """Write the flat tensors' layout (every unit's: `flatten_blocks` makes one) into a checkpoint step folder."""
    (step_dir / FLAT_LAYOUT_FILE).write_text(json.dumps(model.blocks[0].layout(), indent=1))


def read_layout(step_dir: Path) -> Layout:
    """The layout `save_layout` wrote into a checkpoint step folder."""
    return json.loads((step_dir / FLAT_LAYOUT_FILE).read_text())


def unflatten_state_dict(state: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """A state dict with each block's flat tensors (`blocks.N.<path>`) split back into their members
    (`blocks.N.<member>`); other keys as they are."""
    out = {}
    for key, value in state.items():
        flat = re.fullmatch(r"(blocks\.\d+)\.(.+)", key)  # "blocks.3.matmul.decay" -> "blocks.3", "matmul.decay"
        if flat is None or flat[2] not in layout:
            out[key] = value
            continue
        named = layout[flat[2]]
        pieces = value.split([torch.Size(shape).numel() for _, shape in named])
        out.update({f"{flat[1]}.{name}": piece.reshape(shape) for (name, shape), piece in zip(named, pieces)})
    return out
