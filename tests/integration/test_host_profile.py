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


def test_memory_phases_reports_the_plan_and_groups_live_tensors_by_site(tmp_path: Path) -> None:
    """benchmarks.memory_phases: on CPU the report holds the planner's terms (no allocator to measure); its grouping
    of a CUDA snapshot's live blocks names each by the innermost owning frame, and what has no frames as 'before'."""
    from benchmarks.memory_phases import BEFORE, live_by_owner

    out = tmp_path / "mem.txt"
    cmd = [*torchrun(1), "-m", "benchmarks.memory_phases", "--out", str(out), "--warmup", "1", "--", "--mode",
           "hybrid", "--zero-engine", "fsdp2", "--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "32",
           "--wandb", "disabled"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=train_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = out.read_text()
    assert re.search(r"^  peak +[\d.]+$", report, re.M) and "no measurement: cpu" in report
    accum = subprocess.run([*cmd, "--grad-accum", "2"], capture_output=True, text=True, env=train_env(), cwd=ROOT,
                           timeout=300)
    assert accum.returncode != 0 and "use --grad-accum 1" in accum.stderr, accum.stderr[-3000:]

    def block(size: int, *files: str) -> dict:
        return {"state": "active_allocated", "size": size,
                "frames": [{"filename": f, "name": f"fn{i}", "line": 1} for i, f in enumerate(files)]}

    snapshot = {"segments": [{"blocks": [
        block(8, "/x/torch/_ops.py", "/x/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "/w/gpt2/model/gpt.py"),
        block(4, "/x/torch/_ops.py", "/w/gpt2/model/gpt.py"), block(2), {"state": "inactive", "size": 64}]}]}
    assert live_by_owner(snapshot) == {"_fully_shard/_fsdp_param.py:fn1": 8, "model/gpt.py:fn1": 4, BEFORE: 2}
