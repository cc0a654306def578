"""Test-session setup shared by all test modules.

Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when a
kernel is decorated (at import), so it is set here, before any test module imports a kernel.
"""

import gc
import logging
import os

import pytest
import torch
import torch.distributed as dist

from tests.train_runs import ReferenceRun, step_losses, train_reference

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def gpt2_logs_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with the `gpt2` logger propagating (to pytest's caplog): a run's console set-up
    (gpt2.observe.run_logging.setup_console, e.g. train.main called in-process by an earlier test) turns propagation
    off."""
    monkeypatch.setattr(logging.getLogger("gpt2"), "propagate", True)


@pytest.fixture
def gloo_world():
    """A one-rank gloo group in this process (an in-memory store), destroyed after the test, its threads with it:
    models sharded over it (FSDP2's reference cycles) keep the group alive until a garbage collection, and a later
    test of this worker that forks ranks (tests/_tp_harness.spawn) hung when forked beside gloo's threads."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    gc.collect()


@pytest.fixture
def gloo_launch(gloo_world, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gloo_world` with torchrun's variables of its one rank set, so `init_distributed` takes that group as a
    launched run's: an engine of a multi-process mode (DDP, FSDP2) built in this process."""
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(var, value)


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory) -> ReferenceRun:
    """The `--mode single` run of REFERENCE_ARGS that the TP and mode tests compare with, trained once per session
    (read-only: a test that trains from its checkpoint writes elsewhere)."""
    ref = train_reference(tmp_path_factory.mktemp("reference"))
    losses = step_losses(ref.run_dir)
    assert losses[-1] < losses[0] - 1.0  # the model learns: the comparisons cover real updates
    return ref
