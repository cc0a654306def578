"""Interrupt a running train.py and compare what it saved and what a resume gives with an uninterrupted run.

Shared by tests/integration/test_preemption.py (plain processes) and tests/integration/test_slurm.py (Slurm jobs). The
learning rate is
constant (no warm-up, --min-lr = --lr) so that losses do not depend on --max-steps: an interrupted run with a
huge --max-steps, its resume to step S + k and a reference run to a fixed step agree step by step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from tests.train_runs import TINY_ARGS

PREEMPT_ARGS = TINY_ARGS + ["--data", "synthetic", "--batch-size", "2", "--seed", "5", "--eval-batches", "1",
                            "--warmup-steps", "0", "--lr", "1e-3", "--min-lr", "1e-3"]
NEVER_ENDS = ["--max-steps", "100000"]  # stopped by the signal long before
REFERENCE_STEPS = 16  # an uninterrupted run this long covers the interrupted step + the resumed steps
RESUMED_STEPS = 3


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    # training records only (an eval record has the step too, but val_* metrics instead of loss)
    return [r["step"] for line in lines if line.endswith("}") and "loss" in (r := json.loads(line))]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, alive: Callable[[], bool] = lambda: True,
             log: Path | None = None) -> None:
    """Poll `predicate` every 0.1 s; AssertionError naming `what` (and the end of `log`) after `timeout` s or
    once `alive()` is False."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or not alive():
            tail = log.read_text()[-3000:] if log and log.is_file() else ""
            raise AssertionError(f"timed out ({timeout:.0f} s) or the process ended waiting for {what}\n{tail}")
        time.sleep(0.1)


def saved_step(save_dir: Path) -> int:
    """The step of save_dir's latest checkpoint (from its meta.json)."""
    latest = (save_dir / "latest").read_text().strip()
    return json.loads((save_dir / latest / "meta.json").read_text())["step"]
