"""`--zero3-unit-blocks N` / `--fsdp2-unit-blocks N`: N consecutive transformer blocks as one module, a DeepSpeed
ZeRO-3 leaf module or an FSDP2 `fully_shard` unit (`RunLayout.block_unit_blocks` says which N).

Both engines' host work is per hooked module: each one's forward and backward hooks fetch, release and (DeepSpeed)
trace its parameters, a fixed cost per call, and under --compile each compiled graph adds its own (guards, the
compiled function's wrappers). A unit of N blocks has one hook set, one coalesced gather and one graph per pass
instead of N; the price is N blocks' weights gathered at once. Under --zero3-fetch flat and --fsdp2-params flat the
unit is flattened as one (a few flat tensors per unit: gpt2.runtime.flat_blocks).

    model.blocks[u]                 # a BlockUnit: blocks u*N .. u*N + N-1
      .layers[j]                    # the Block itself, unchanged

DeepSpeed's checkpoints hold the unit names (`blocks.U.layers.J.<name>`); `ungroup_state_dict` gives back
`blocks.{U*N+J}.<name>` for export. FSDP2's over their own tensors hold the blocks' own names (its engine renames by
`block_key` when saving and loading), so they do not depend on N; over flat tensors they hold the unit's, as
DeepSpeed's do."""

from __future__ import annotations

import re

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

_UNIT_KEY = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(.+)")  # "blocks.1.layers.2.attn.c_attn.weight"


class BlockUnit(nn.Module):
    """`layers` run in order: one DeepSpeed leaf module or FSDP2 unit (under --zero3-fetch flat or --fsdp2-params flat
    one FlatBlock's content). `checkpoint_layers`: in training, each layer is recomputed in backward on its own
    (`RunLayout.checkpoints_in_units`), rather than GPT.forward checkpointing the whole unit."""

    def __init__(self, blocks: list[nn.Module], checkpoint_layers: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.checkpoint_layers = checkpoint_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_layers and self.training else block(x)
        return x


def group_blocks(model: nn.Module, unit_blocks: int, checkpoint_layers: bool = False) -> None:
    """Replace `model.blocks` by BlockUnits of `unit_blocks` consecutive blocks, in place; the last unit takes what is
    left (FSDP2 allows that; the CLI checks that --zero3-unit-blocks divides the blocks)."""
    blocks = list(model.blocks)
    model.blocks = nn.ModuleList(BlockUnit(blocks[i:i + unit_blocks], checkpoint_layers)
                                 for i in range(0, len(blocks), unit_blocks))


def block_key(key: str, unit_blocks: int) -> str:
    """A unit's parameter name (`blocks.U.layers.J.<name>`) under its block's own index
    (`blocks.{U * unit_blocks + J}.<name>`); other names as they are."""
    unit = _UNIT_KEY.fullmatch(key)
    return key if unit is None else f"blocks.{int(unit[1]) * unit_blocks + int(unit[2])}.{unit[3]}"


def ungroup_state_dict(state: dict[str, torch.Tensor], unit_blocks: int) -> dict[str, torch.Tensor]:
    """A state dict with each unit's keys (`blocks.U.layers.J.<name>`) back under their block's own index
    (`blocks.{U * unit_blocks + J}.<name>`); other keys as they are."""
    return {block_key(key, unit_blocks): value for key, value in state.items()}
