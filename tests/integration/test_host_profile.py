"""benchmarks.zero3_host_profile: the step time and the host functions of a ZeRO-3 step (world size 1, gloo)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.train_runs import ROOT, train_env
from tools.common import torchrun


def test_reports_step_time_and_deepspeeds_host_functions(tmp_path: Path) -> None:
    out = tmp_path / "hp.txt"
    cmd = [*torchrun(1), "-m", "benchmarks.zero3_host_profile", "--out", str(out), "--warmup", "1", "--steps", "1",
           "--profile-steps", "1", "--", "--mode", "hybrid", "--model", "gpt2-tiny", "--batch-size", "2",
           "--seq-len", "32", "--grad-accum", "2", "--wandb", "disabled"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=train_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out.read_text()
    assert re.search(r"^step: [\d.]+ ms over 1 steps$", report, re.M)
    assert "train_step" in report.split("== cumulative time, all functions")[1]  # the loop's step, by cumulative time
    deepspeed_part = report.split("== cumulative time, DeepSpeed's functions")[1]
    assert "deepspeed/runtime/zero/" in deepspeed_part  # ZeRO-3's hooks are among the profiled functions
