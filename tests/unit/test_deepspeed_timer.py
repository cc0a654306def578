"""DeepSpeed's throughput timer is off in every hybrid run unless its DeepSpeed file turns it on: on, it synchronizes
the device at every forward's start and optimizer step's end (`gpt2.config.deepspeed_file.throughput_timer_defaults`),
which a host-bound ZeRO-3 step cannot afford."""

import json
from pathlib import Path

import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.config import get_timers_config
from deepspeed.utils.timer import ThroughputTimer

from gpt2.config.cli import parse_args
from gpt2.config.deepspeed_file import build_ds_config
from gpt2.config.layout import RunLayout

STEPS = 2


def device_syncs(ds: dict, monkeypatch: pytest.MonkeyPatch) -> int:
    """How often DeepSpeed's throughput timer, configured from `ds` as the engine configures it, synchronizes the
    device over STEPS steps (start at the forward, stop after the optimizer step)."""
    calls: list[None] = []
    monkeypatch.setattr(type(get_accelerator()), "synchronize", lambda self, device_index=None: calls.append(None))
    timer = ThroughputTimer(get_timers_config(ds), batch_size=1, start_step=0)
    for _ in range(STEPS):
        timer.start()
        timer.stop(global_step=True)
    return len(calls)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_throughput_timer_never_synchronizes_unless_the_file_asks(stage: int, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_args(["--mode", "hybrid", "--zero-stage", str(stage), "--device", "cpu"])
    assert device_syncs(build_ds_config(RunLayout.resolve(cfg, 1, torch.device("cpu"))), monkeypatch) == 0
    path = tmp_path / "ds.json"
    cfg.parallel.ds_config = str(path)
    for section in ({"enabled": True}, {"synchronized": True}):  # a section in the file is used as it is
        path.write_text(json.dumps({"timers": {"throughput": section}}))
        ds = build_ds_config(RunLayout.resolve(cfg, 1, torch.device("cpu")))
        assert device_syncs(ds, monkeypatch) == 2 * STEPS, section
