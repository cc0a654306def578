"""The tools beside training check their own arguments as train.py does, and a failed row shows its reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.train_runs import ROOT
from tools import train_sweep
from tools.common import last_error


@pytest.mark.parametrize("layout", [["--nodes", "0", "--nproc-per-node", "8"],
                                    ["--nodes", "-2", "--nproc-per-node", "2"],
                                    ["--nodes", "1", "--nproc-per-node", "0"]])
def test_preflight_refuses_a_layout_of_no_processes(layout: list[str]) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "slurm" / "preflight.py"), *layout, "--", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "must be a positive integer" in done.stderr and "ok" not in done.stdout, done


@pytest.mark.parametrize(("flags", "why"), [(["--gpus", "0"], "--gpus: must be a positive integer"),
                                           (["--model", "gpt2-huge"], "--model: invalid choice: 'gpt2-huge'")])
def test_train_sweep_refuses_what_cannot_run(flags: list[str], why: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as refused:
        train_sweep.parse_args([*flags, "--dry-run"])
    assert refused.value.code == 2 and why in capsys.readouterr().err


def test_a_refused_runs_reason_is_its_rows_error() -> None:
    log = ("train.py: error: --seq-len 2048 exceeds the model's 1024 positions (gpt2); use --seq-len <= 1024\n"
           "E1201 torch/distributed/elastic/multiprocessing/api.py: failed (exitcode: 2) local_rank: 0\n"
           "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 2 (pid: 7)\n")
    assert last_error(log).startswith("train.py: error: --seq-len 2048 exceeds")
