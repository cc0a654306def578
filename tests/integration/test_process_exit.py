"""What a run leaves in its process: a launched entry point (train.py, tools.hf_reference) exits with `main`'s
status and its output flushed, whatever interpreter finalization would do; `train.main` called in-process puts back
what it changed.

The stand-in for the crash that finalization caused: an atexit hook that aborts, as a gloo group destroyed there
intermittently did ("terminate called without an active exception", exit -6 after a finished run, CI failures).
"""

from __future__ import annotations

import errno
import json
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


class _FillingFile:
    """A file whose third write fills the disk half-way through its data (ENOSPC)."""

    def __init__(self, file):
        self._file, self._writes = file, 0

    def write(self, data):
        self._writes += 1
        if self._writes < 3:
            return self._file.write(data)
        self._file.write(data[:len(data) // 2])
        self._file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def test_a_run_folder_that_fills_up_stops_in_one_line_with_whole_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """metrics.jsonl refused mid-record: exit 74 and one line naming it; every record left in it is whole."""
    import train
    from gpt2.observe import run_logging

    def opened(path, *args, **kwargs):
        file = open(path, *args, **kwargs)  # noqa: SIM115 (the run closes it)
        return _FillingFile(file) if Path(path).name == "metrics.jsonl" else file

    monkeypatch.setattr(run_logging, "open", opened, raising=False)
    assert train.main(["--model", "gpt2-tiny", "--data", "synthetic", "--max-steps", "6", "--log-interval", "1",
                       "--eval-batches", "0", "--out-dir", str(tmp_path), "--run-name", "full"]) == 74
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(lines) == 1 and f"no space left on device while writing {tmp_path / 'full' / 'metrics.jsonl'}" in (
        lines[0]), err[-3000:]
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
