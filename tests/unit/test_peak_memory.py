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
from gpt2.observe import metrics
from gpt2.observe.metrics import MemoryStats, PeakMemory
from gpt2.train import loop
from tests.train_runs import TINY_ARGS


def _readings(values: list[float]) -> Iterator[MemoryStats]:
    """What the allocator's counter reads, call after call (reserved = allocated + 1); the last value repeats."""
    stats = [MemoryStats(v, v + 1, 0) for v in values]
    return itertools.chain(stats, itertools.repeat(stats[-1]))


def test_running_max_outlasts_a_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = _readings([5.0, 9.0, 2.0, 3.0])
    monkeypatch.setattr(metrics, "memory_stats", lambda device: next(readings))
    memory = PeakMemory(torch.device("cpu"))
    peaks = []
    for _ in range(4):
        memory.observe()
        peaks.append(memory.peak.peak_allocated_gib)
    assert peaks == [5.0, 9.0, 9.0, 9.0]
    assert memory.peak.peak_reserved_gib == 10.0


def _train_with_counter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, high_in: str) -> tuple[dict, dict]:
    """train.main in-process for 4 steps, --log-interval 3 (steps 1, 3 and 4 logged), with an allocator counter that
    reads 7 GiB (8 reserved) only during `high_in` ("step 2" or "the final evaluation") and 1 GiB otherwise, as if
    reset after it. Returns {logged step: peak allocated} and the summary."""
    phase = {"now": ""}
    real_train_step, real_evaluate = loop.train_step, loop._evaluate
    steps = itertools.count(1)

    def train_step(*args: Any, **kwargs: Any) -> Any:
        phase["now"] = f"step {next(steps)}"
        return real_train_step(*args, **kwargs)

    def evaluate(*args: Any, **kwargs: Any) -> Any:  # the only one: --eval-interval is 0
        phase["now"] = "the final evaluation"
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", train_step)
    monkeypatch.setattr(loop, "_evaluate", evaluate)
    monkeypatch.setattr(metrics, "memory_stats", lambda device: MemoryStats(7.0, 8.0, 0) if phase["now"] == high_in
                        else MemoryStats(1.0, 2.0, 0))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    out = tmp_path / "runs"
    assert train.main(TINY_ARGS + ["--data", "synthetic", "--max-steps", "4", "--log-interval", "3", "--eval-batches",
                                   "1", "--batch-size", "2", "--out-dir", str(out), "--run-name", "peak"]) == 0
    records = [json.loads(line) for line in (out / "peak" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["mem/peak_allocated_gib"] for r in records if r.get("type") == "step" and "loss" in r}
    return logged, json.loads((out / "peak" / "summary.json").read_text())


def test_run_reads_memory_after_every_step_not_only_logged_ones(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    logged, summary = _train_with_counter(tmp_path, monkeypatch, "step 2")
    assert logged == {1: 1.0, 3: 7.0, 4: 7.0}
    assert (summary["mem/peak_allocated_gib"], summary["mem/peak_reserved_gib"]) == (7.0, 8.0)


def test_the_final_evaluation_s_peak_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logged, summary = _train_with_counter(tmp_path, monkeypatch, "the final evaluation")
    assert logged == {1: 1.0, 3: 1.0, 4: 1.0}
    assert (summary["mem/peak_allocated_gib"], summary["mem/peak_reserved_gib"]) == (7.0, 8.0)


def test_records_say_what_a_run_holds_after_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mem/allocated_after_step_gib` is read after the step: not before the first one (5 GiB: weights only), not
    inside one (9 GiB: activations live), but after each (3 GiB)."""
    phase = {"now": "before"}
    real_train_step = loop.train_step

    def train_step(*args: Any, **kwargs: Any) -> Any:
        phase["now"] = "inside"
        try:
            return real_train_step(*args, **kwargs)
        finally:
            phase["now"] = "after"

    monkeypatch.setattr(loop, "train_step", train_step)
    monkeypatch.setattr(loop, "allocated_gib", lambda device: {"before": 5.0, "inside": 9.0, "after": 3.0}[
        phase["now"]])
    _, summary = _train_with_counter(tmp_path, monkeypatch, "step 2")
    records = [json.loads(line) for line in (tmp_path / "runs" / "peak" / "metrics.jsonl").read_text().splitlines()]
    held = [r["mem/allocated_after_step_gib"] for r in records if r.get("type") == "step" and "loss" in r]
    assert held == [3.0, 3.0, 3.0]
    assert summary["mem/allocated_after_step_gib"] == 3.0


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from Linux's /proc")
def test_a_cpu_run_reads_its_resident_memory() -> None:
    """On CPU the reading is the process's resident set in GiB: above zero and at most its peak resident set."""
    held = metrics.allocated_gib(torch.device("cpu"))
    assert held is not None and 0.01 < held <= metrics.memory_stats(torch.device("cpu")).peak_allocated_gib * 1.01
