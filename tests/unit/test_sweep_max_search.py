"""tools.train_sweep's search for the largest batch that fits skips the sizes the planner says do not fit on this
host's GPUs before launching them: on 4 H100s an FSDP2 + TP2 run at batch 96 (planned 119 GiB of 75) hung in its
collectives after one rank ran out of memory, instead of failing, and ended the search with nothing measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gpt2.planning.planner
from tools import train_sweep


def test_the_max_search_skips_sizes_the_planner_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    tried: list[int] = []

    def fake_launch(cmd: list[str], log_path: Path, timeout: float) -> tuple[int, float]:
        batch = int(cmd[cmd.index("--batch-size") + 1])
        tried.append(batch)
        run_dir = Path(cmd[cmd.index("--out-dir") + 1]) / cmd[cmd.index("--run-name") + 1]
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(
            {"mode": "baseline", "world_size": 4, "batch_size_per_gpu": batch, "tokens_per_s": 1.0, "mfu": 0.1,
             "step_time_s": 1.0, "final_loss": 5.0, "device": "fake"}))
        log_path.write_text("ok\n")
        return 0, 1.0

    monkeypatch.setattr(train_sweep, "launch", fake_launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # plan for an 80 GB GPU on this CPU machine
    monkeypatch.setattr(gpt2.planning.planner, "device_memory_gib", lambda requested: 79.2)
    assert train_sweep.main(["--gpus", "4", "--modes", "baseline", "--fused", "none", "--batches", "max",
                             "--max-batches", "96", "64", "32", "--extra-args=--compile", "--out",
                             str(tmp_path)]) == 0
    assert tried == [32]  # DDP, GPT-2 Large: 96 and 64 are planned above 75.2 GiB, 32 below (67.3 measured)
    out = capsys.readouterr().out
    assert "baseline-none-b96: skipped, the planner's peak" in out and "does not fit in 75.2 GiB" in out
    assert "baseline-none-b64: skipped" in out


def test_flags_train_py_refuses_do_not_stop_the_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An FSDP2-only flag in --extra-args makes train.py refuse the DDP row; the plan gives way to the run, which
    fails as a row of its own, and the sweep goes on (an exception here ended the sweep)."""
    tried: list[str] = []

    def fake_launch(cmd: list[str], log_path: Path, timeout: float) -> tuple[int, float]:
        tried.append(cmd[cmd.index("--run-name") + 1])
        log_path.write_text("ConfigError: --fsdp2-gather: an FSDP2 setting\n")
        return 2, 1.0

    monkeypatch.setattr(train_sweep, "launch", fake_launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt2.planning.planner, "device_memory_gib", lambda requested: 79.2)
    train_sweep.main(["--gpus", "4", "--modes", "baseline", "fsdp2", "--fused", "none", "--batches", "max",
                      "--max-batches", "8", "--extra-args=--compile --fsdp2-gather fp32", "--out", str(tmp_path)])
    assert tried == ["baseline-none-b8", "fsdp2-none-b8"]
