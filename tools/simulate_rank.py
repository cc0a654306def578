"""One rank of an N-rank layout, run alone on this machine's one device: its memory, compute and host path.

    python -m tools.simulate_rank --world-size 4 -- --mode hybrid --tp-size 2 --model gpt2-large --compile --profile
    python -m tools.simulate_rank --world-size 8 --rank 3 -- --mode baseline --model gpt2 --batch-size 16

Everything after `--` is train.py's command line, run unchanged in this process as rank `--rank` of `--world-size`
(the TP x DP grid, the data shard, the ZeRO or FSDP2 shards and the planner are that rank's), over the process group
of parallel/simulated.py: every collective returns at once, moving nothing, with stand-in values. So the run shows
what one GPU of the layout holds (per-rank peak memory beside the planner's prediction), computes and spends on the
host (with --profile: device busy, host time, kernels and collective calls a step), never what the layout achieves:
its tokens/s and MFU assume free communication and its losses are not the layout's. The run folder is named
`simulated-...`, its summary carries `simulated: true`, its console lines say SIMULATED, and tools.report labels it;
it carries no parity verdict and belongs in no throughput table beside real runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from gpt2.config.cli import parse_args as parse_train_args
from gpt2.config.schema import ConfigError

NOT_SIMULATED = {  # train.py's flags whose work one simulated rank cannot do, and why
    "save_dir": "a checkpoint of one simulated rank is not a checkpoint of its layout",
    "resume": "a simulated rank starts from scratch",
}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m tools.simulate_rank", description=__doc__.split("\n\n")[0],
        usage="%(prog)s --world-size N [--rank R] -- TRAIN_PY_FLAGS...")
    parser.add_argument("--world-size", type=int, required=True, help="processes in the layout simulated (>= 2)")
    parser.add_argument("--rank", type=int, default=0, help="the rank run here (default 0)")
    ours, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    if args.world_size < 2:
        parser.error(f"--world-size {args.world_size}: a simulated layout has at least 2 ranks "
                     "(one rank is a real run: python train.py --mode single)")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank} is not a rank of --world-size {args.world_size} (0 to {args.world_size - 1})")
    return args, train_argv


def check_train_argv(train_argv: list[str], rank: int, world_size: int) -> list[str]:
    """train.py's command line, refused before any work where one rank cannot run it; the run folder named
    `simulated-r<R>of<N>-...` unless --run-name is given."""
    cfg = parse_train_args(train_argv)
    if cfg.train.mode == "single":
        raise ConfigError("--mode single has no ranks to simulate: give the layout's --mode baseline or hybrid")
    if rank != 0 and cfg.train.mode == "hybrid" and cfg.parallel.zero_engine == "deepspeed":
        raise ConfigError(f"--rank {rank}: DeepSpeed checks that its ranks agree by broadcasting rank 0's lists, which "
                          "a simulated rank other than 0 cannot answer: simulate --rank 0 (or --zero-engine fsdp2)")
    for name, why in NOT_SIMULATED.items():
        if getattr(cfg.checkpoint, name):
            raise ConfigError(f"--{name.replace('_', '-')} is not simulated ({why}): drop it")
    if cfg.log.run_name:
        return train_argv
    name = f"simulated-r{rank}of{world_size}-{cfg.train.mode}-{cfg.train.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    return [*train_argv, "--run-name", name]


def main(argv: list[str] | None = None) -> int:
    args, train_argv = parse(sys.argv[1:] if argv is None else argv)
    try:
        train_argv = check_train_argv(train_argv, args.rank, args.world_size)
    except ConfigError as err:
        print(f"simulate_rank: error: {err}", file=sys.stderr)
        return 2
    from gpt2.train.main import main as train_main
    from parallel.simulated import init_simulated

    # what torchrun would set for this rank, on a node of one process; the group exists before train.py looks
    os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    init_simulated(args.rank, args.world_size)
    return train_main(train_argv)


if __name__ == "__main__":
    from gpt2.runtime.distributed import run_as_process

    run_as_process(main)
