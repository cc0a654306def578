"""tools.train_sweep's launch line: torchrun's own parser accepts it, --numa-binding included."""

from __future__ import annotations

import pytest
from torch.distributed.run import get_args_parser

from tools import train_sweep


@pytest.mark.parametrize("binding", [None, "node", "socket"])
def test_numa_binding_reaches_torchrun(binding: str | None) -> None:
    argv = ["--gpus", "4", "--modes", "fsdp2", "--batches", "8"] + (["--numa-binding", binding] if binding else [])
    cmd = train_sweep.command(train_sweep.parse_args(argv), "fsdp2", "none", 8, "fsdp2-none-b8")
    launcher = get_args_parser().parse_args(cmd[3:])  # after `python -m torch.distributed.run`
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and launcher.training_script.endswith("train.py")
    assert (launcher.numa_binding, launcher.nproc_per_node) == (binding, "4")
    assert "--zero-engine" in launcher.training_script_args  # the rest is train.py's


@pytest.mark.parametrize(("extra_args", "variant"), [
    ("--compile", ""), ("--compile --profile", "profiled"),
    ("--compile --compile-wrapper cpp", "--compile-wrapper cpp"), ("", "")])
def test_store_variant_leaves_out_what_columns_hold(extra_args: str, variant: str) -> None:
    """The store's compile column holds --compile: a variant repeating it printed "(--compile)" after the label."""
    assert train_sweep.store_variant(extra_args) == variant
