"""Run one check function on every rank of a process group: gloo on CPU for pytest, NCCL under torchrun.

pytest: `spawn(check, world, tp)` forks `world` gloo ranks on 127.0.0.1. Ranks are forked, not spawned:
on a 2-core machine four spawned interpreters importing torch take about 20 s to start, forked ones
under a second. Forking a process that has run multithreaded CPU ops is safe only if the children stay
single-threaded (libgomp is not fork-safe), so every rank sets one intra-op thread first, as DataLoader
workers do; the forked checks never touch CUDA. An assertion in any rank fails the test with that
rank's traceback.

GPU: the same checks over NCCL, one process per GPU (benchmarks/gpu_tp.sh):

    torchrun --nproc_per_node=4 -m tests._tp_harness --check model --tp 2   # --check groups | layers | model
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.dims import ParallelDims
from tools.common import free_port

Check = Callable[..., None]  # check(dims, *args), run on every rank
CHECK_NAMES = ("groups", "layers", "model")  # --check choices (torchrun entry)


def named_check(name: str) -> Check:
    """The check function a --check name runs (imported here: the test modules import this one)."""
    if name == "groups":
        from tests.unit.test_tp_dims import run_group_checks

        return run_group_checks
    if name == "layers":
        from tests.unit.test_tp_layers import run_layer_checks

        return run_layer_checks
    from tests.unit.test_tp_model import run_model_checks

    return run_model_checks


def device() -> torch.device:
    """Where the checks put their tensors: the rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run(check: Check, world: int, rank: int, tp: int, args: tuple) -> None:
    try:
        dims = ParallelDims(world_size=world, rank=rank, tp_size=tp)
        dims.build_groups()
        check(dims, *args)
    finally:
        dist.destroy_process_group()


def _entry(rank: int, world: int, tp: int, port: int, check: Check, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),  # what torchrun sets (DeepSpeed reads them)
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # before any op: fork safety (see above), and 4 ranks share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _run(check, world, rank, tp, args)


def spawn(check: Check, world: int, tp: int, *args) -> None:
    """Run `check(dims, *args)` on `world` gloo ranks laid out as a (world/tp) x tp grid."""
    mp.start_processes(_entry, args=(world, tp, free_port(), check, args), nprocs=world, join=True,
                       start_method="fork")


def main() -> None:
    """torchrun entry: run one named check over NCCL, one GPU per rank (gloo on a machine without CUDA)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", choices=CHECK_NAMES, required=True)
    p.add_argument("--tp", type=int, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: before any kernel is imported
    check = named_check(args.check)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 tolerances assume true fp32 GEMMs
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    _run(check, world, rank, args.tp, ())
    if rank == 0:
        print(f"OK: {args.check} on {world} ranks ({backend}), tp={args.tp}", flush=True)


if __name__ == "__main__":
    main()
