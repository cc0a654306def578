"""What the step studies (`zero3_host_profile`, `memory_phases`) share: their own flags before `--` and train.py's
after it, and the run train.py would build from those (layout, process group, synthetic data; then the tool builds
its engine), so that they measure the engine and step users train with."""

from __future__ import annotations

from gpt2.config.cli import parse_args as parse_train_args
from gpt2.config.layout import RunLayout
from gpt2.data.loader import DataBundle, build_data
from gpt2.runtime.distributed import DistContext, init_distributed


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's flags, train.py's flags): split at the first `--`."""
    split = argv.index("--") if "--" in argv else len(argv)
    return argv[:split], argv[split + 1:]


def launch(train_argv: list[str]) -> tuple[RunLayout, DistContext, DataBundle]:
    """train.py's layout, process group and data (synthetic tokens, forced) for these flags; the engine is
    `gpt2.engines.build.build_engine(layout, ctx)`, after the tool's own checks of the layout."""
    cfg = parse_train_args([*train_argv, "--data", "synthetic"])
    layout, ctx = init_distributed(cfg)
    t = cfg.train
    data = build_data(cfg.data, seq_len=t.seq_len, batch_size=t.batch_size, model_vocab_size=cfg.model.vocab_size,
                      dp_rank=ctx.dims.dp_rank, dp_size=ctx.dims.dp_size, seed=t.seed, is_main=ctx.is_main,
                      barrier=ctx.barrier)
    return layout, ctx, data
