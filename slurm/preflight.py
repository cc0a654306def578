"""Pre-flight for the Slurm scripts: fail in seconds, with the fix, before srun starts any process.

    python slurm/preflight.py --nodes 2 --nproc-per-node 8 -- --mode hybrid --tp-size 2 --model gpt2-large

Checks the train.py flags with train.py's own parser, then what only the allocation decides: the world size
(nodes x processes per node) against --tp-size, --mode and --global-batch-size; --tp-size must divide the
processes per node so that every tensor-parallel group (consecutive ranks) stays inside one node's NVLink;
the model's heads / width / vocab and the sequence split must divide by --tp-size; and, on GPU runs, this node
must see at least --nproc-per-node GPUs. Exit 0: fits; 2: does not fit (the message says why).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2.config.cli import parse_args
from gpt2.config.layout import RunLayout  # noqa: E402
from gpt2.config.schema import ConfigError, positive_int


def check(nodes: int, nproc_per_node: int, train_argv: list[str], visible_gpus: int | None) -> str:
    """Raise ConfigError when the layout does not fit; returns a one-line description when it does.
    `visible_gpus` None: do not check GPUs (a CPU run)."""
    cfg = parse_args(train_argv)
    world = nodes * nproc_per_node
    tp = cfg.parallel.tp_size
    if nproc_per_node % tp:
        raise ConfigError(f"--tp-size {tp} does not divide the {nproc_per_node} processes per node: a tensor-parallel "
                          f"group would span two nodes; use a --tp-size that divides {nproc_per_node}")
    layout = RunLayout.resolve(cfg, world, "cpu" if visible_gpus is None else "cuda")
    if visible_gpus is not None and visible_gpus < nproc_per_node:
        raise ConfigError(f"{nproc_per_node} processes per node but this node sees {visible_gpus} GPUs; request "
                          f"--gpus-per-node={nproc_per_node} (#SBATCH) or lower NPROC_PER_NODE")
    return (f"{cfg.train.mode} {cfg.train.model}: world {world} = {nodes} nodes x {nproc_per_node}, "
            f"tp {tp} x dp {layout.dp_size}, grad accum {layout.grad_accum}")


def _visible_gpus(train_argv: list[str]) -> int | None:
    cfg = parse_args(train_argv)
    if cfg.train.device == "cpu":
        return None
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="preflight.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=positive_int, required=True)
    p.add_argument("--nproc-per-node", type=positive_int, required=True)
    p.add_argument("train_argv", nargs=argparse.REMAINDER, help="-- then the train.py flags")
    args = p.parse_args(argv)
    train_argv = args.train_argv[1:] if args.train_argv[:1] == ["--"] else args.train_argv
    try:
        print(f"preflight: ok: {check(args.nodes, args.nproc_per_node, train_argv, _visible_gpus(train_argv))}")
    except ConfigError as err:
        print(f"preflight: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
