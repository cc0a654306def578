"""Peak memory survives a library resetting the allocator's peak counter mid-run (DeepSpeed's DeepCompile does, in its
profiling steps and when its eval graph compiles): the run's figures are the running max of per-step readings."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import train
from gpt2 import metrics, trainer
from gpt2.metrics import MemoryStats, PeakMemory
from tests.train_runs import TINY_ARGS


def _readings(values: list[float]) -> Iterator[MemoryStats]:
    """What the allocator's counter reads, call after call (reserved = allocated + 1); the last value repeats."""
    stats = [MemoryStats(v, v + 1, 0) for v in values]
    return itertools.chain(stats, itertools.repeat(stats[-1]))


def test_running_max_outlasts_a_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = _readings([5.0, 9.0, 2.0, 3.0])
    monkeypatch.setattr(metrics, "memory_stats", lambda device: next(readings))
    memory = PeakMemory(torch.device("cpu"))
    peaks = [memory.observe().peak_allocated_gib for _ in range(4)]
    assert peaks == [5.0, 9.0, 9.0, 9.0]
    assert memory.observe().peak_reserved_gib == 10.0


def test_run_reads_memory_after_every_step_not_only_logged_ones(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # the counter reads 7 GiB only during step 2, which is not logged (--log-interval 3 logs steps 1, 3 and 4);
    # a reset after it leaves 1 GiB for the rest of the run, its evaluation included
    current = {"step": 0}
    real_train_step = trainer.train_step

    def counting_train_step(*args: Any, **kwargs: Any) -> Any:
        current["step"] += 1
        return real_train_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", counting_train_step)
    monkeypatch.setattr(metrics, "memory_stats",
                        lambda device: MemoryStats(7.0, 8.0, 0) if current["step"] == 2 else MemoryStats(1.0, 2.0, 0))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    out = tmp_path / "runs"
    assert train.main(TINY_ARGS + ["--data", "synthetic", "--max-steps", "4", "--log-interval", "3", "--eval-batches",
                                   "1", "--batch-size", "2", "--out-dir", str(out), "--run-name", "peak"]) == 0
    records = [json.loads(line) for line in (out / "peak" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["mem/peak_allocated_gib"] for r in records if r.get("type") == "step" and "loss" in r}
    assert logged == {1: 1.0, 3: 7.0, 4: 7.0}
    summary = json.loads((out / "peak" / "summary.json").read_text())
    assert (summary["mem/peak_allocated_gib"], summary["mem/peak_reserved_gib"]) == (7.0, 8.0)
