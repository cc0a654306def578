"""`--zero3-unit-blocks N`: N consecutive transformer blocks as one DeepSpeed ZeRO-3 leaf module.

DeepSpeed's host work is per leaf module as well as per tensor: each leaf's forward and backward hooks fetch,
release and trace its parameters, a fixed cost per call. A unit of N blocks has one hook set and one coalesced
gather per pass instead of N, and under --compile one graph instead of N; the price is N blocks' weights gathered
at once. Under --zero3-fetch flat the unit is flattened as one (a few flat tensors per unit).

    model.blocks[u]                 # a BlockUnit: blocks u*N .. u*N + N-1
      .layers[j]                    # the Block itself, unchanged

Checkpoints hold the unit names (`blocks.U.layers.J.<name>`); `ungroup_state_dict` gives back `blocks.{U*N+J}.<name>`
for export."""

from __future__ import annotations

import re

import torch
import torch.nn as nn


class BlockUnit(nn.Module):
    """`layers` run in order: one DeepSpeed leaf module, or under --zero3-fetch flat one FlatBlock's content."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
        for block in self.layers:
            x = block(x)
        return x


def group_blocks(model: nn.Module, unit_blocks: int) -> None:
    """Replace `model.blocks` by BlockUnits of `unit_blocks` consecutive blocks, in place (the CLI checks that
    `unit_blocks` divides the blocks)."""
    blocks = list(model.blocks)
    assert len(blocks) % unit_blocks == 0, (len(blocks), unit_blocks)
    model.blocks = nn.ModuleList(BlockUnit(blocks[i:i + unit_blocks]) for i in range(0, len(blocks), unit_blocks))


def ungroup_state_dict(state: dict[str, torch.Tensor], unit_blocks: int) -> dict[str, torch.Tensor]:
    """A state dict with each unit's keys (`blocks.U.layers.J.<name>`) back under their block's own index
    (`blocks.{U * unit_blocks + J}.<name>`); other keys as they are."""
    out = {}
    for key, value in state.items():
        unit = re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(.+)", key)  # "blocks.1.layers.2.attn.c_attn.weight"
        out[key if unit is None else f"blocks.{int(unit[1]) * unit_blocks + int(unit[2])}.{unit[3]}"] = value
    return out
