"""Spawn a gloo process group on 127.0.0.1 and run one check function on every rank.

Ranks are forked, not spawned: on a 2-core machine, four spawned interpreters importing torch take
about 20 s to start, forked ones under a second. Forking a process that has run multithreaded CPU ops
is safe only if the children stay single-threaded (libgomp is not fork-safe), so every rank sets one
intra-op thread first, as DataLoader workers do; the checks never touch CUDA. An assertion in any rank
fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.dims import ParallelDims

Check = Callable[..., None]  # check(dims, *args), run on every rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, tp: int, port: int, check: Check, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # before any op: fork safety (see above), and 4 ranks share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dims = ParallelDims(world_size=world, rank=rank, tp_size=tp)
        dims.build_groups()
        check(dims, *args)
    finally:
        dist.destroy_process_group()


def spawn(check: Check, world: int, tp: int, *args) -> None:
    """Run `check(dims, *args)` on `world` gloo ranks laid out as a (world/tp) x tp grid."""
    mp.start_processes(_entry, args=(world, tp, free_port(), check, args), nprocs=world, join=True,
                       start_method="fork")
