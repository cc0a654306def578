"""ParallelDims: the validated tp x dp grid of ranks and its process groups.

Ranks are laid out as `arange(world).view(dp, tp)`: tensor-parallel groups are rows (consecutive
ranks, which share a node and its NVLink), data-parallel groups are columns. With 4 GPUs, TP=2:

    grid = [[0, 1],      TP groups: [0, 1], [2, 3]
            [2, 3]]      DP groups: [0, 2], [1, 3]

Everything that needs a group receives it from this object; there are no module-level globals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gpt2.config import ConfigError, ModelConfig, RunConfig, check_tp_divides_world


@dataclass
class ParallelDims:
    world_size: int
    rank: int
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    dp_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_tp_divides_world(self.world_size, self.tp_size)

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

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

    def validate_model(self, cfg: ModelConfig) -> None:
        """Shapes that tensor parallelism splits must divide by tp_size."""
        tp = self.tp_size
        if tp == 1:
            return
        checks = [
            ("n_head", cfg.n_head, "--n-head"),
            ("4*n_embd (MLP width)", 4 * cfg.n_embd, "--n-embd"),
            ("padded vocab", cfg.padded_vocab_size, "vocab padding (drop --no-pad-vocab)"),
        ]
        common = math.gcd(*(value for _, value, _ in checks))
        usable = [d for d in range(1, min(common, 64) + 1) if common % d == 0]  # divide every split shape
        for what, value, knob in checks:
            if value % tp:
                raise ConfigError(f"--tp-size {tp} does not divide {what} = {value}; choose --tp-size "
                                  f"from {usable} (they divide n_head, 4*n_embd and the padded vocab) "
                                  f"or change {knob}")

    def validate_run(self, cfg: RunConfig) -> None:
        """The model and sequence checks of a launch (train.py, and `--plan` for the layout it plans)."""
        self.validate_model(cfg.model)
        self.validate_sequence(cfg.train.seq_len, cfg.parallel.sequence_parallel)

    def validate_sequence(self, seq_len: int, sequence_parallel: bool) -> None:
        """Sequence parallelism shards the sequence into tp_size equal blocks."""
        if sequence_parallel and self.tp_size > 1 and seq_len % self.tp_size:
            raise ConfigError(f"--sequence-parallel needs --seq-len divisible by --tp-size {self.tp_size}, "
                              f"got {seq_len}; use --seq-len {seq_len - seq_len % self.tp_size} or drop "
                              f"--sequence-parallel")
