"""tools.common.launch ends a timed-out launch with everything it started, also the processes torchrun puts in
sessions of their own (its workers), which a signal to the launch's process group does not reach: a rank stuck in a
collective (it catches SIGTERM, as train.py does to save at the next step) once outlived its torchrun and held its
GPU's memory through the rest of a 4-GPU call."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests._processes import alive
from tools import common

# a stand-in for torchrun: starts a "worker" in a session of its own that ignores SIGTERM, records its pid, and waits
LAUNCHER = """import signal, subprocess, sys, time
worker = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "open(sys.argv[1], 'w').write(str(os.getpid()) + chr(10)); time.sleep(120)")
subprocess.Popen([sys.executable, '-c', worker.replace('sys.argv[1]', repr(sys.argv[1]))], start_new_session=True)
time.sleep(120)
"""


def test_a_timed_out_launch_ends_workers_in_their_own_sessions(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "STOP_GRACE_S", 1.0)
    pid_file = tmp_path / "worker.pid"
    rc, _ = common.launch([sys.executable, "-c", LAUNCHER, str(pid_file)], tmp_path / "launch.log", timeout=5.0)
    assert rc is None  # timed out
    assert pid_file.exists(), (tmp_path / "launch.log").read_text()
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = alive(worker)
    if survived:
        os.kill(worker, signal.SIGKILL)
    assert not survived, "the launch's worker outlived it"
