"""Preemption without Slurm: a signal to a running train.py saves a checkpoint at a step boundary, the process
exits with EXIT_PREEMPTED, and `--resume auto` continues with the losses of an uninterrupted run.

Cases: SIGUSR1 to a single process; SIGUSR1 to rank 1 only of a 2-process torchrun DDP run (the all-reduced
flag makes rank 0 stop at the same step); SIGTERM to the torchrun agent, which forwards it to its workers
(checkpoint and exit checked; its resume is the same as the others'); Ctrl-C (SIGINT) to a single process: the same
checkpoint, exit 130 and the resume command; a second Ctrl-C stops at once.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from gpt2.train.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED, PreemptionWatcher
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
        elif send == "int":
            proc.send_signal(signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.read_text()


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Callable[[int, str, int], list[float]]:
    """Uninterrupted losses per (processes, device), at least `steps` of them (REFERENCE_STEPS at least: a tiny model
    on a GPU may run a dozen steps between the test's signal and its arrival), computed on first use."""
    root, cache = tmp_path_factory.mktemp("reference"), {}

    def get(nproc: int, device: str, steps: int) -> list[float]:
        if len(cache.get((nproc, device), [])) < steps:
            steps = max(steps, REFERENCE_STEPS)
            name = f"ref{nproc}-{device}-{steps}"
            run_train(PREEMPT_ARGS + _flags(nproc, device) + ["--max-steps", str(steps), "--run-name", name],
                      root, nproc=nproc)
            cache[nproc, device] = step_losses(root / name)
        return cache[nproc, device]

    return get


TWO_GPUS = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.mark.parametrize("nproc,send,device", [
    (1, "usr1", "cpu"), (2, "usr1-rank1", "cpu"), (2, "term-agent", "cpu"), (1, "int", "cpu"),
    pytest.param(2, "usr1-rank1", "cuda", marks=TWO_GPUS),  # the flag's all-reduce over NCCL
])
def test_signal_saves_at_step_boundary_and_resume_is_exact(tmp_path: Path, references, nproc: int, send: str,
                                                           device: str) -> None:
    code, out = _interrupt(tmp_path, nproc, send, device)
    if nproc == 1:
        assert code == (EXIT_INTERRUPTED if send == "int" else EXIT_PREEMPTED), out[-3000:]
    else:
        # torchrun exits 1 (a worker failed) or with its SignalException (it got SIGTERM itself)
        assert code != 0, out[-3000:]
        if send == "usr1-rank1":  # both workers decide to stop (the signalled one and its peer, told by the flag)
            assert "preempted by SIGUSR1 after step" in out and "preempted by a peer's signal after step" in out
            # torchrun's failure report lists the workers' own exit codes; when one exits first, torchrun may
            # SIGTERM the other on its way out (seen on a loaded 2-core machine), so at least one reads 75
            assert out.count(f"exitcode  : {EXIT_PREEMPTED} ") >= 1, out[-3000:]
    if send == "int":
        assert "Ctrl-C: stopping after this step" in out and "interrupted by SIGINT after step" in out, out[-3000:]
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    else:
        assert "preempted by " in out, out[-3000:]
    if nproc == 1:  # the command to run, this one's flags with --resume auto
        assert "(resume with --resume auto: python train.py --model gpt2-tiny" in out, out[-3000:]
        assert out.count("--resume auto") == 2 and "--resume auto)" in out, out[-3000:]
    else:
        assert "(resume with --resume auto (the same launch))" in out, out[-3000:]
    ck = tmp_path / "ck"
    step = saved_step(ck)
    # a step boundary: the last logged step is the saved one, and only that step was saved
    assert logged_steps(tmp_path / "interrupted")[-1] == step >= 3
    assert sorted(p.name for p in ck.iterdir()) == ["latest", f"step-{step:06d}"]
    # the stop follows the signal at once: after the step in flight (one process), or one step later (distributed:
    # the all-reduced flag is read a step late); the signalled processes say when it came
    came_after = min(int(k) for k in re.findall(r"the signal came after step (\d+)", out))
    assert step <= came_after + (1 if nproc == 1 else 2), f"the signal came after step {came_after}, stop: {step}"
    if send in ("term-agent", "int"):
        return  # the resume itself is the same as after SIGUSR1, checked by the other cases

    run_train(PREEMPT_ARGS + _flags(nproc, device) + ["--max-steps", str(step + RESUMED_STEPS), "--run-name",
                                                      "resumed", "--save-dir", str(ck), "--resume", "auto"],
              tmp_path, nproc=nproc)
    ref = references(nproc, device, step + RESUMED_STEPS)
    assert step_losses(tmp_path / "interrupted") == ref[:step]
    assert step_losses(tmp_path / "resumed") == ref[step:step + RESUMED_STEPS]  # bit-identical


def test_a_second_ctrl_c_stops_at_once() -> None:
    """The first SIGINT is only recorded (a checkpoint follows at the step boundary); the second raises
    KeyboardInterrupt where the process is, which train.main reports in one line (exit 130)."""
    watcher = PreemptionWatcher()
    try:
        signal.raise_signal(signal.SIGINT)
        assert watcher.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        watcher.restore()


def test_a_second_ctrl_c_in_train_main_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    import train
    from gpt2.train import loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "run_training", interrupted)
    assert train.main(PREEMPT_ARGS + ["--max-steps", "2", "--out-dir", str(tmp_path / "runs"),
                                      "--save-dir", str(tmp_path / "ck")]) == EXIT_INTERRUPTED
    assert (f"train.py: stopped at once by a second Ctrl-C; newest checkpoint: none in {tmp_path / 'ck'}"
            in capsys.readouterr().err)


def test_the_entry_installs_its_watcher_before_torch_loads() -> None:
    """`gpt2-train` and train.py import gpt2.train.main, then call its `cli`, which installs the watcher first: the
    module (and the shim) must load no torch, or a SIGTERM during that import would still be a bare exit 143."""
    code = "import sys, train, gpt2.train.main; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=train_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_preemption_during_start_up_checkpoints_after_the_first_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """SIGTERM while train.py parses its flags (before torch loads, the model or the data exist) is a preemption like
    a later one: step 1's checkpoint, exit 75; the process's handler before and after is the test's own."""
    import train
    from gpt2.train import main as entry

    def unexpected(signum: int, frame: object) -> None:
        pytest.fail("SIGTERM reached the handler train.main found: none of its own was installed yet")

    def parse_when_preempted(argv: list[str]):
        signal.raise_signal(signal.SIGTERM)
        return parse_args(argv)

    from gpt2.config.cli import parse_args

    previous = signal.signal(signal.SIGTERM, unexpected)
    try:
        monkeypatch.setattr(entry, "parse_args", parse_when_preempted)  # train.main's body reads it there
        ck = tmp_path / "ck"
        assert train.main(PREEMPT_ARGS + ["--max-steps", "3", "--out-dir", str(tmp_path / "runs"),
                                          "--save-dir", str(ck)]) == EXIT_PREEMPTED
        assert saved_step(ck) == 1
        assert "preempted by SIGTERM after step 1" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is unexpected
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ranks_agree_one_step_later_without_waiting_for_this_step(gloo_world) -> None:
    """Distributed, each call reads the previous call's all-reduced flag (reading this step's would wait for the
    device every step): a signal before call k stops every rank at call k + 1; one process reads its own flag."""
    from types import SimpleNamespace

    watcher = PreemptionWatcher(signals=())
    ctx = SimpleNamespace(distributed=True, device=torch.device("cpu"))
    assert watcher.should_stop(ctx, 1) is False
    watcher._handle(signal.SIGUSR1, None)  # during step 2
    assert watcher.came_after == 1
    assert watcher.should_stop(ctx, 2) is False  # this call's flag is read by the next
    assert watcher.should_stop(ctx, 3) is True
    watcher._handle(signal.SIGTERM, None)
    assert watcher.came_after == 1  # the first signal's
    assert watcher.should_stop(SimpleNamespace(distributed=False), 4) is True
