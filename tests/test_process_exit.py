"""How a launched entry point (train.py, benchmarks.hf_reference) leaves: with `main`'s status and its output
flushed, whatever interpreter finalization would do.

The stand-in for the crash it prevents: an atexit hook that aborts, as a gloo group destroyed at finalization
intermittently did ("terminate called without an active exception", exit -6 after a finished run, CI failures).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_runs import ROOT

ENTRY_POINT = """
import atexit, logging, os, sys
from gpt2.distributed import run_as_process

def main() -> int:
    atexit.register(os.abort)  # finalization would crash the process
    logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
    logging.getLogger("run").info("logged at the end of the run")
    sys.stdout.write("printed without a newline")  # still in the stdout buffer when main returns
    return int(sys.argv[2])

run_as_process(main)
"""


@pytest.mark.parametrize("status", [0, 3])
def test_a_returned_status_is_the_exit_status_with_output_flushed_and_no_finalization(tmp_path: Path,
                                                                                      status: int) -> None:
    log = tmp_path / "console.log"
    done = subprocess.run([sys.executable, "-c", ENTRY_POINT, str(log), str(status)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout == "printed without a newline"
    assert "logged at the end of the run" in log.read_text()
