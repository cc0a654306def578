"""What a run leaves in its process: a launched entry point (train.py, tools.hf_reference) exits with `main`'s
status and its output flushed, whatever interpreter finalization would do; `train.main` called in-process puts back
what it changed.

The stand-in for the crash that finalization caused: an atexit hook that aborts, as a gloo group destroyed there
intermittently did ("terminate called without an active exception", exit -6 after a finished run, CI failures).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_runs import ROOT

ENTRY_POINT = """
import atexit, ctypes, logging, os, sys
from gpt2.runtime.distributed import run_as_process

def main() -> int:
    atexit.register(os.abort)  # finalization would crash the process
    logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
    logging.getLogger("run").info("logged at the end of the run")
    ctypes.CDLL(None).printf(b"printed by C;")  # in libc's stdout buffer (stdout is a pipe)
    sys.stdout.write("printed without a newline")  # in Python's stdout buffer
    return int(sys.argv[2])

run_as_process(main)
"""


@pytest.mark.parametrize("status", [0, 3])
def test_a_returned_status_is_the_exit_status_with_output_flushed_and_no_finalization(tmp_path: Path,
                                                                                      status: int) -> None:
    log = tmp_path / "console.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a launched run's stdout
    done = subprocess.run([sys.executable, "-c", ENTRY_POINT, str(log), str(status)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr[-2000:]
    assert "printed without a newline" in done.stdout and "printed by C;" in done.stdout
    assert "logged at the end of the run" in log.read_text()


def test_train_main_in_process_puts_back_the_signal_handlers_it_replaced(tmp_path: Path, capsys) -> None:
    """A test or a notebook calling train.main must not be left with SIGTERM ignored (only flagged) afterwards."""
    import train
    from gpt2.train.preemption import PREEMPT_SIGNALS

    before = {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS}
    # fails at the data, after the watcher is installed
    assert train.main(["--data-path", str(tmp_path / "missing"), "--out-dir", str(tmp_path / "runs")]) == 2
    assert "missing" in capsys.readouterr().err
    assert {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS} == before


def test_a_second_console_set_up_closes_the_first_run_s_console_log(tmp_path: Path) -> None:
    from gpt2.observe.run_logging import log, setup_console

    (tmp_path / "a").mkdir()
    setup_console(tmp_path / "a", is_main=True)
    first = next(h for h in log.handlers if isinstance(h, logging.FileHandler))
    log.info("first run")
    setup_console(None, is_main=True)
    assert first.stream is None  # closed: FileHandler.close drops its stream
    assert "first run" in (tmp_path / "a" / "console.log").read_text()
