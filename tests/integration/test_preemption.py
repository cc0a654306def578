"""Preemption without Slurm: a signal to a running train.py saves a checkpoint at a step boundary, the process
exits with EXIT_PREEMPTED, and `--resume auto` continues with the losses of an uninterrupted run.

Cases: SIGUSR1 to a single process; SIGUSR1 to rank 1 only of a 2-process torchrun DDP run (the all-reduced
flag makes rank 0 stop at the same step); SIGTERM to the torchrun agent, which forwards it to its workers
(checkpoint and exit checked; its resume is the same as the others').
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from gpt2.train.preemption import EXIT_PREEMPTED
from tests.preempt_runs import (
    NEVER_ENDS,
    PREEMPT_ARGS,
    REFERENCE_STEPS,
    RESUMED_STEPS,
    logged_steps,
    saved_step,
    wait_for,
)
from tests.train_runs import ROOT, run_train, step_losses, train_command, train_env

pytestmark = pytest.mark.slow


def _flags(nproc: int, device: str) -> list[str]:
    return ["--mode", "single" if nproc == 1 else "baseline", "--device", device]


def _launch(args: list[str], out_dir: Path, nproc: int, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: nobody reads the output while it runs
        return subprocess.Popen(train_command(nproc) + args + ["--out-dir", str(out_dir)], env=train_env(), cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT)


def _worker_pid(agent: subprocess.Popen, rank: int) -> int:
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker with RANK={rank} under torchrun {agent.pid}")


def _interrupt(tmp: Path, nproc: int, send: str, device: str) -> tuple[int, str]:
    """Start a never-ending run, signal it after step 3 as `send` says; returns (exit code, output)."""
    log = tmp / "interrupted.log"
    args = PREEMPT_ARGS + _flags(nproc, device) + NEVER_ENDS + ["--run-name", "interrupted",
                                                               "--save-dir", str(tmp / "ck")]
    proc = _launch(args, tmp, nproc, log)
    try:
        wait_for(lambda: len(logged_steps(tmp / "interrupted")) >= 3, 120, "step 3", lambda: proc.poll() is None,
                 log)
        if send == "usr1":
            proc.send_signal(signal.SIGUSR1)
        elif send == "usr1-rank1":
            psutil.Process(_worker_pid(proc, 1)).send_signal(signal.SIGUSR1)
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.read_text()


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Callable[[int, str], list[float]]:
    """Uninterrupted losses per (processes, device), computed on first use."""
    root, cache = tmp_path_factory.mktemp("reference"), {}

    def get(nproc: int, device: str) -> list[float]:
        if (nproc, device) not in cache:
            name = f"ref{nproc}-{device}"
            run_train(PREEMPT_ARGS + _flags(nproc, device) + ["--max-steps", str(REFERENCE_STEPS), "--run-name", name],
                      root, nproc=nproc)
            cache[nproc, device] = step_losses(root / name)
        return cache[nproc, device]

    return get


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.mark.parametrize("nproc,send,device", [
    (1, "usr1", "cpu"), (2, "usr1-rank1", "cpu"), (2, "term-agent", "cpu"),
    pytest.param(2, "usr1-rank1", "cuda", marks=TWO_GPUS),  # the flag's all-reduce over NCCL
])
def test_signal_saves_at_step_boundary_and_resume_is_exact(tmp_path: Path, references, nproc: int, send: str,
                                                           device: str) -> None:
    code, out = _interrupt(tmp_path, nproc, send, device)
    if nproc == 1:
        assert code == EXIT_PREEMPTED, out[-3000:]
    else:
        # torchrun exits 1 (a worker failed) or with its SignalException (it got SIGTERM itself)
        assert code != 0, out[-3000:]
        if send == "usr1-rank1":  # both workers decide to stop (the signalled one and its peer, told by the flag)
            assert "preempted by SIGUSR1 after step" in out and "preempted by a peer's signal after step" in out
            # torchrun's failure report lists the workers' own exit codes; when one exits first, torchrun may
            # SIGTERM the other on its way out (seen on a loaded 2-core machine), so at least one reads 75
            assert out.count(f"exitcode  : {EXIT_PREEMPTED} ") >= 1, out[-3000:]
    assert "preempted by " in out and "(resume with --resume auto)" in out, out[-3000:]
    ck = tmp_path / "ck"
    step = saved_step(ck)
    # a step boundary: the last logged step is the saved one, and only that step was saved
    assert logged_steps(tmp_path / "interrupted")[-1] == step >= 3
    assert sorted(p.name for p in ck.iterdir()) == ["latest", f"step-{step:06d}"]
    assert step + RESUMED_STEPS <= REFERENCE_STEPS, f"the signal took {step} steps to act"
    if send == "term-agent":
        return  # the resume itself is the same as after SIGUSR1, checked by the other cases

    run_train(PREEMPT_ARGS + _flags(nproc, device) + ["--max-steps", str(step + RESUMED_STEPS), "--run-name",
                                                      "resumed", "--save-dir", str(ck), "--resume", "auto"],
              tmp_path, nproc=nproc)
    ref = references(nproc, device)
    assert step_losses(tmp_path / "interrupted") == ref[:step]
    assert step_losses(tmp_path / "resumed") == ref[step:step + RESUMED_STEPS]  # bit-identical
