"""Process-group set-up: device choice, backend (NCCL on GPU, gloo on CPU), launcher checks."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gpt2.config.layout import RunLayout
from gpt2.config.schema import ConfigError, RunConfig
from gpt2.runtime.rendezvous import check_launcher_values
from parallel.dims import ParallelDims
from parallel.simulated import is_simulated

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Collective timeout (GPT2_COLLECTIVE_TIMEOUT_MIN, minutes). Rank 0 tokenises a missing token cache while the others
# wait at a barrier (WikiText-103: minutes), so this must outlast that; `python -m gpt2.data ...` pre-builds the cache.
TIMEOUT_ENV = "GPT2_COLLECTIVE_TIMEOUT_MIN"
COLLECTIVE_TIMEOUT_MIN = 60


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dims: ParallelDims
    simulated: bool = False  # one rank run alone through parallel.simulated: its peers and collectives are not real

    @property
    def is_main(self) -> bool:
        """The rank that logs, writes the run folder and builds a missing token cache: rank 0, or a simulated rank
        (the only process of its layout)."""
        return self.rank == 0 or self.simulated

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """An integer environment variable (a launcher's, or ours); a ConfigError naming it when it is not one."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"environment variable {name}={text!r} is not an integer >= {minimum}; correct or unset it")
    return value


def launched_by_launcher() -> bool:
    return all(v in os.environ for v in LAUNCHER_VARS)


def pick_device(requested: str | None, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA GPU is visible; use --device cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                          "launch at most one process per GPU")
    return torch.device("cuda", local_rank)


def check_launch(cfg: RunConfig) -> None:
    """Distributed modes need a launcher; cheap, so it runs before anything heavy."""
    if cfg.train.mode in ("baseline", "hybrid") and not launched_by_launcher():
        raise ConfigError(
            f"--mode {cfg.train.mode} needs a distributed launcher that sets {', '.join(LAUNCHER_VARS)}: "
            f"run `torchrun --nproc_per_node=N train.py --mode {cfg.train.mode} ...`"
            + (" or `deepspeed --num_gpus=N train.py --mode hybrid ...`" if cfg.train.mode == "hybrid" else "")
            + ", or use --mode single")


def init_distributed(cfg: RunConfig) -> tuple[RunLayout, DistContext]:
    """Validate the launch, pick the device, resolve the run layout, create the process group and the TP/DP grid."""
    check_launch(cfg)
    world_size, rank = env_int("WORLD_SIZE", 1, minimum=1), env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    if (world_size, rank, local_rank) != (1, 0, 0) and not launched_by_launcher():
        given = " ".join(f"{v}={os.environ[v]}" for v in LAUNCHER_VARS if v in os.environ)
        missing = ", ".join(v for v in LAUNCHER_VARS if v not in os.environ)
        raise ConfigError(f"the environment has {given} but no {missing}: left over from another launch (a launcher "
                          "sets them all)? unset them for one process, or launch with torchrun")
    given_group = dist.is_initialized()  # made by the caller (tools.simulate_rank): no rendezvous, used as it is
    if not given_group:
        check_launcher_values(world_size, rank, local_rank)  # before the rendezvous, which would wait for them
    timeout = timedelta(minutes=env_int(TIMEOUT_ENV, COLLECTIVE_TIMEOUT_MIN, minimum=1))
    device = pick_device(cfg.train.device, local_rank)
    layout = RunLayout.resolve(cfg, world_size, device)
    dims = ParallelDims(world_size=world_size, rank=rank, tp_size=layout.tp_size)
    if device.type == "cuda" and dims.tp_size > 1 and cfg.parallel.tp_overlap:
        # one hardware queue, so each async TP input-gradient collective is issued before the weight-gradient
        # GEMM it overlaps (read when the CUDA context is created, i.e. by set_device below; set it to override)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if layout.mode != "single":
        if given_group:
            check_given_group(world_size, rank)
        else:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
        dims.build_groups()
    return layout, DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device, dims=dims,
                               simulated=is_simulated())


def check_given_group(world_size: int, rank: int) -> None:
    """A process group that exists before the launch is read must be the launch's."""
    if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
        raise ConfigError(f"a process group of world size {dist.get_world_size()} (rank {dist.get_rank()}) exists, "
                          f"but WORLD_SIZE={world_size} RANK={rank}: set the launcher variables to the group's")


def shutdown_distributed(all_ranks_finished: bool) -> None:
    """Destroy the process groups; after a finished run, only once every rank has left its last collective,
    so no rank tears its connections down while a peer still uses them. After an error the peers may be gone:
    no barrier then."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if all_ranks_finished:
        dist.barrier()
    dist.destroy_process_group()


def run_as_process(main: Callable[[], int]) -> None:
    """Run a launched entry point (train.py, tools.hf_reference, the ZeRO host-cost repro, host profile and memory
    phases) and exit with its status.

    faulthandler: a crash in native code (segfault, std::terminate) prints every thread's Python stack on each rank.
    Once `main` has returned (its process groups destroyed, its files closed), the process leaves with `os._exit`,
    skipping interpreter finalization: objects that still hold a gloo group (DeepSpeed's module-level caches and
    hooks) are otherwise destroyed there, and that intermittently aborts a finished run with "terminate called
    without an active exception" (exit -6: train.py's and the Hugging Face reference's 2- and 4-rank CPU ZeRO
    runs, a failed CI each time; a gc.collect() before exit did not stop it). An exception from `main` takes the
    normal path: its traceback and exit status 1. Logging handlers flush every record; Python's and C's stdio
    buffers are flushed here."""
    faulthandler.enable()
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # C stdio's buffers too (NCCL_DEBUG, native printf): _exit skips libc's flush
    os._exit(status)
