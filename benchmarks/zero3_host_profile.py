"""Where a training step's host time goes: step time, then Python's cProfile over a few steps, by function.

    torchrun --nproc_per_node=1 -m benchmarks.zero3_host_profile --out /tmp/hp.txt -- --mode hybrid --model gpt2-large
    python -m benchmarks.zero3_host_profile --out /tmp/hp-single.txt -- --model gpt2-large     # single, to compare

The flags after `--` are train.py's (synthetic tokens are forced). The data, the engine and the step are the ones
train.py runs (`gpt2.data.loader.build_data`, `gpt2.engines.build.build_engine`, `gpt2.train.loop.train_step`). The
report lists
the mean step time over `--steps` timed steps (after `--warmup`; no device synchronisation inside them), then the
functions with the most own (tottime) and cumulative time over `--profile-steps` profiled steps, all of them and
DeepSpeed's own separately: what the GPU waits for when a ZeRO-3 step (DeepSpeed's or FSDP2's) is host-bound (the
2xH200 study: benchmarks/results/profiles/h200x2-2026-11-27). cProfile slows Python code down,
so its times rank the host work; the timed steps give the real step time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

from benchmarks.launched_step import launch, split_argv
from gpt2.engines.build import build_engine
from gpt2.runtime.distributed import run_as_process, shutdown_distributed
from gpt2.train.loop import train_step


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    own, train_argv = split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.zero3_host_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the report (text)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="functions per table")
    return p.parse_args(own), train_argv


def main(argv: list[str] | None = None) -> int:
    args, train_argv = parse_args(argv)
    layout, ctx, data = launch(train_argv)
    engine = build_engine(layout, ctx)

    def step() -> None:
        train_step(layout, ctx, engine, data)

    def synchronize() -> None:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize()
    step_s = (time.perf_counter() - start) / args.steps

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profile_steps):
        step()
    synchronize()
    profiler.disable()

    if ctx.is_main:
        # the step time only: a throughput figure belongs next to a parity verdict (tools.train_sweep)
        lines = [f"flags: {' '.join(train_argv)}", f"device: {ctx.device} "
                 f"({torch.cuda.get_device_name() if ctx.device.type == 'cuda' else 'cpu'}), torch {torch.__version__}",
                 f"step: {step_s * 1e3:.1f} ms over {args.steps} steps", ""]
        for title, sort, restrict in (("own time (tottime), all functions", "tottime", ()),
                                      ("cumulative time, all functions", "cumulative", ()),
                                      ("cumulative time, DeepSpeed's functions", "cumulative", ("deepspeed",)),
                                      ("own time (tottime), DeepSpeed's functions", "tottime", ("deepspeed",))):
            buffer = io.StringIO()
            stats = pstats.Stats(profiler, stream=buffer).strip_dirs() if not restrict else pstats.Stats(
                profiler, stream=buffer)
            stats.sort_stats(sort).print_stats(*restrict, args.top)
            lines += [f"== {title}, {args.profile_steps} profiled steps", buffer.getvalue()]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines))
        print("\n".join(lines[:3]) + f"\nwrote {args.out}")
    shutdown_distributed(all_ranks_finished=True)
    return 0


if __name__ == "__main__":
    run_as_process(main)
