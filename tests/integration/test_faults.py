"""Fault injection: real runs killed (SIGKILL) at every stage of a checkpoint save and at random instants, then
`--resume auto`.

Each fault tried (single process, `--save-interval 1 --keep-last 1`, killed at the save of step 2 through
GPT2_TEST_KILL_AT) and the outcome this file asserts:

- tmp-created, rank-state-written, model-state-written, meta-written, manifest-written, synced: step 2's save is a
  `step-000002.tmp` (never read, removed by the next save) -> resumes from step 1
- pending-written: `latest.pending` names step 2, not renamed yet (ignored) -> step 1
- renamed: a complete `step-000002` that `latest` does not name (the old code exited 2 here) -> step 2, warning
- latest-written: `latest` names step 2, step 1 not pruned yet -> step 2
- prune-renamed, prune-partial: step 1 renamed to `step-000001.deleting`, then half deleted -> step 2
- pruned: the save finished -> step 2

In every case the resumed run's losses equal the uninterrupted run's (bit-identical, CPU fp32), and the save
dir ends with `latest` and the newest checkpoint only: no `.tmp`, `.deleting` or `latest.pending` left.

- 4 SIGKILLs of one run at random instants (0-0.4 s after each launch's first step record, one in each quarter of
  that window: inside a step, a save or a prune), each followed by `--resume auto` -> every step any launch logged
  equals the uninterrupted run's (bit-identical), and the run finishes with `latest` and its last checkpoint only.

The same with 2 gloo ranks under torchrun, DDP and ZeRO-3, in tests/integration/test_faults_ddp.py and
tests/integration/test_faults_zero3.py (tests/fault_chain.py): the stages (DDP all 12; ZeRO-3 the 2 around the
engine's writes and pruned) and 2 random kills (the whole job, and one rank) chained in one run, each launch
resuming from the newest complete checkpoint (the stage outcomes above) within 1e-6 of the uninterrupted run. The
commit stages (from meta-written on) run on rank 0 alone; at tmp-created rank 0 dies, at rank-state-written and
model-state-written every rank does.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpt2.train.checkpoint import FAULT_ENV, SAVE_STAGES
from tests.fault_chain import RANDOM_WINDOW_S, kill_delays
from tests.train_runs import (
    ROOT,
    TINY_ARGS,
    read_killed_records,
    run_train,
    step_values,
    summary,
    train_command,
    train_env,
)

ARGS = TINY_ARGS + ["--data", "synthetic", "--max-steps", "4", "--seed", "7", "--batch-size", "2",
                    "--eval-batches", "1", "--save-interval", "1", "--keep-last", "1"]
KILL_STEP = 2
BEFORE_RENAME = ("tmp-created", "rank-state-written", "model-state-written", "meta-written", "manifest-written",
                 "synced", "pending-written")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    run_train(ARGS + ["--run-name", "full", "--save-dir", str(root / "ck")], root)
    return root / "full"


def _killed_run(args: list[str], out_dir: Path, stage: str, step: int = KILL_STEP) -> subprocess.CompletedProcess:
    env = train_env() | {FAULT_ENV: f"{stage}@{step}"}
    return subprocess.run(train_command(1) + args + ["--out-dir", str(out_dir)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_stages_are_the_documented_ones() -> None:
    assert set(SAVE_STAGES) == set(BEFORE_RENAME) | {"renamed", "latest-written", "prune-renamed", "prune-partial",
                                                      "pruned"}


@pytest.mark.parametrize("stage", SAVE_STAGES)
def test_kill_at_every_save_stage_then_resume_auto_continues_exactly(reference: Path, tmp_path: Path,
                                                                     stage: str) -> None:
    ck = tmp_path / "ck"
    killed = _killed_run(ARGS + ["--run-name", "killed", "--save-dir", str(ck)], tmp_path, stage)
    assert killed.returncode == -9, f"not killed at {stage}: rc {killed.returncode}\n{killed.stderr[-3000:]}"
    for folder in ck.glob("step-*"):  # what a resume could pick is whole; the rest is named .tmp / .deleting
        if folder.suffix not in (".tmp", ".deleting"):
            assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "meta.json", "model.pt",
                                                                 "optimizer.pt", "rank-00000.pt"], folder

    proc = run_train(ARGS + ["--run-name", "resumed", "--save-dir", str(ck), "--resume", "auto"], tmp_path)
    expected_start = 1 if stage in BEFORE_RENAME else KILL_STEP
    assert summary(tmp_path / "resumed")["start_step"] == expected_start
    if stage == "renamed":
        assert "resuming from the newer step-000002" in proc.stderr
    for key in ("loss", "grad_norm"):
        assert step_values(tmp_path / "resumed", key) == step_values(reference, key)[expected_start:], key
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000004"]


def test_a_kill_before_the_rename_after_resuming_from_a_pending_checkpoint_resumes_from_it_again(
        reference: Path, tmp_path: Path) -> None:
    """Killed after step 2's rename (`latest` still names step 1, `latest.pending` step 2), resumed from step 2, then
    killed at step 3's pending-written: `latest.pending` now names the unrenamed step 3. The next resume must start
    from step 2 again (CI's ZeRO-3 fault chain hit this: it went back to `latest` and refused to overwrite step 2)."""
    ck = tmp_path / "ck"
    for name, stage, step in (("first", "renamed", KILL_STEP), ("second", "pending-written", KILL_STEP + 1)):
        killed = _killed_run(ARGS + ["--run-name", name, "--save-dir", str(ck), "--resume", "auto"], tmp_path, stage,
                             step)
        assert killed.returncode == -9, f"not killed at {stage}@{step}: rc {killed.returncode}\n{killed.stderr[-3000:]}"
    run_train(ARGS + ["--run-name", "resumed", "--save-dir", str(ck), "--resume", "auto"], tmp_path)
    assert summary(tmp_path / "resumed")["start_step"] == KILL_STEP
    for key in ("loss", "grad_norm"):
        assert step_values(tmp_path / "resumed", key) == step_values(reference, key)[KILL_STEP:], key
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000004"]


@pytest.mark.slow
@pytest.mark.soak
def test_kills_at_random_instants_then_resume_auto_each_time(tmp_path: Path) -> None:
    """One run SIGKILLed again and again at a random instant (0-0.4 s after its first new step record, the instants
    spread over that window by kill_delays: inside a step, a save or a prune), each time continued with --resume
    auto, until 4 kills; then it finishes. Every step any of its processes logged equals the uninterrupted run's
    (bit-identical)."""
    import random
    import signal
    import time

    steps, n_kills = 16, 4  # a kill advances the run 1-2 steps
    args = [a if a != "4" else str(steps) for a in ARGS]  # --max-steps
    run_train(args + ["--run-name", "full", "--save-dir", str(tmp_path / "ck-full")], tmp_path)
    reference = step_values(tmp_path / "full", "loss")
    assert len(reference) == steps
    ck, out = tmp_path / "ck", tmp_path / "runs"
    delays = kill_delays(n_kills, random.Random(17), RANDOM_WINDOW_S)
    kills, cycles = 0, 0
    while True:
        cycles += 1
        assert cycles <= 60, f"no progress after {kills} kills"
        before = {p.name for p in out.iterdir()} if out.is_dir() else set()
        cmd = train_command(1) + args + ["--run-name", "r", "--save-dir", str(ck),
                                                                 "--resume", "auto", "--out-dir", str(out)]
        proc = subprocess.Popen(cmd, env=train_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        if kills < n_kills:
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                new = [p / "metrics.jsonl" for p in out.glob("r*") if p.name not in before]
                if new and new[0].is_file() and '"type": "step"' in new[0].read_text():
                    break
                time.sleep(0.02)
            time.sleep(delays[kills])
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        _, err = proc.communicate(timeout=300)
        if proc.returncode == 0:
            break
        assert proc.returncode == -9, f"rc {proc.returncode}: {err[-3000:]}"
    assert kills == n_kills
    checked = 0
    for run in out.iterdir():
        for r in read_killed_records(run):  # only a killed writer's last line may be cut
            if r["type"] == "step" and "loss" in r:
                assert r["loss"] == reference[r["step"] - 1], (run.name, r["step"])
                checked += 1
    assert checked >= steps
    assert sorted(p.name for p in ck.iterdir()) == ["latest", f"step-{steps:06d}"]
