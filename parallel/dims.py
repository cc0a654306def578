"""ParallelDims: the tp x dp grid of ranks and its process groups.

Ranks are laid out as `arange(world).view(dp, tp)`: tensor-parallel groups are rows (consecutive
ranks, which share a node and its NVLink), data-parallel groups are columns. With 4 GPUs, TP=2:

    grid = [[0, 1],      TP groups: [0, 1], [2, 3]
            [2, 3]]      DP groups: [0, 2], [1, 3]

Everything that needs a group receives it from this object; there are no module-level globals. It takes
integers: which sizes a run may use (tp divides the world, the model and the sequence) is checked once, with
the fix, by `gpt2.config.layout.RunLayout.resolve`. `dp_size_of` is the one place dp = world / tp is computed
(and `tp_divides_world` the one rule it needs); the run layout and the planner call them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def tp_divides_world(world_size: int, tp_size: int) -> bool:
    return tp_size >= 1 and world_size % tp_size == 0


def dp_size_of(world_size: int, tp_size: int) -> int:
    """The data-parallel size of a world of `world_size` ranks split into TP groups of `tp_size`."""
    if not tp_divides_world(world_size, tp_size):  # the user-facing check, naming the fix, is gpt2.config.layout's
        raise ValueError(f"world_size {world_size} is not a multiple of tp_size {tp_size}")
    return world_size // tp_size


@dataclass
class ParallelDims:
    world_size: int
    rank: int
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    dp_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        dp_size_of(self.world_size, self.tp_size)  # raises on a tp_size that does not divide the world

    @property
    def dp_size(self) -> int:
        return dp_size_of(self.world_size, self.tp_size)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    def grid(self) -> torch.Tensor:
        """[dp, tp] rank grid: row i is TP group i, column j is DP group j."""
        return torch.arange(self.world_size).view(self.dp_size, self.tp_size)

    def build_groups(self) -> None:
        """Create the TP and DP groups (collective: every rank must call it)."""
        grid = self.grid()
        for row in grid.tolist():  # every rank must create every group, in the same order
            group = dist.new_group(row)
            if self.rank in row:
                self.tp_group = group
        for col in grid.t().tolist():
            group = dist.new_group(col)
            if self.rank in col:
                self.dp_group = group
