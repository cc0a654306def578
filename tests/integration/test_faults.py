"""Fault injection: real runs killed (SIGKILL) at every stage of a checkpoint save and at random instants, then
`--resume auto`.

Each fault tried (single process, `--save-interval 1 --keep-last 1`, killed through GPT2_TEST_KILL_AT at the first
save of a launch, each launch of one chain resuming the previous one: tests/fault_chain.py) and what it must resume
from:

- tmp-created, rank-state-written, model-state-written, meta-written, manifest-written, synced: the save of step k
  is a `step-00000k.tmp` (never read, removed by the next save) -> resumes from step k - 1
- pending-written: `latest.pending` names step k, not renamed yet (ignored) -> k - 1
- renamed: a complete `step-00000k` that `latest` does not name (the old code exited 2 here) -> k, warning
- latest-written: `latest` names step k, step k - 1 not pruned yet -> k
- prune-renamed, prune-partial: the older checkpoint renamed to `.deleting`, then half deleted -> k
- pruned: the save finished -> k

After every kill each complete-looking step folder passes its manifest check (every file it lists, nothing else)
and the next launch resumes from the newest of them; every step any launch logged equals the uninterrupted run's
(bit-identical, CPU fp32), and the last launch finishes with `latest` and the newest checkpoint only: no `.tmp`,
`.deleting` or `latest.pending` left. The chain's order puts every stage after a first complete save (a resume
point older than the killed save exists), and pending-written right after renamed: killed after step k's rename
(`latest` still names k - 1, `latest.pending` k), resumed from k, then killed at step k + 1's pending-written
(`latest.pending` now names the unrenamed k + 1), the next launch must resume from k again (CI's ZeRO-3 fault chain
hit this: it went back to `latest` and refused to overwrite step k).

- 4 SIGKILLs of one run at random instants (0-0.4 s after each launch's first step record, one in each quarter of
  that window: inside a step, a save or a prune), each followed by `--resume auto` -> every step any launch logged
  equals the uninterrupted run's (bit-identical), and the run finishes with `latest` and its last checkpoint only.

The same with 2 gloo ranks under torchrun, DDP and ZeRO-3, in tests/integration/test_faults_ddp.py and
tests/integration/test_faults_zero3.py: the stages (DDP 6, fault_chain.DDP_STAGES; ZeRO-3 the 2 around the
engine's writes and pruned) and 2 random kills (the whole job, and one rank) chained in one run, each launch
resuming from the newest complete checkpoint within 1e-6 of the uninterrupted run. The commit stages (from
meta-written on) run on rank 0 alone; at tmp-created rank 0 dies, at rank-state-written and model-state-written every
rank does.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpt2.train.checkpoint import SAVE_STAGES
from tests.fault_chain import RANDOM_WINDOW_S, kill_delays, run_chain
from tests.train_runs import (
    ROOT,
    TINY_ARGS,
    read_killed_records,
    run_train,
    step_values,
    train_command,
    train_env,
)

ARGS = TINY_ARGS + ["--data", "synthetic", "--max-steps", "4", "--seed", "7", "--batch-size", "2",
                    "--eval-batches", "1", "--save-interval", "1", "--keep-last", "1"]
# latest-written first (a complete save: every later kill has an older checkpoint to fall back to), renamed right
# before pending-written (see above)
CHAIN_ORDER = ("latest-written", "tmp-created", "rank-state-written", "model-state-written", "meta-written",
               "manifest-written", "synced", "renamed", "pending-written", "prune-renamed", "prune-partial", "pruned")


def test_the_chain_kills_at_every_stage() -> None:
    assert sorted(CHAIN_ORDER) == sorted(SAVE_STAGES)


def test_kill_at_every_save_stage_then_resume_auto_continues_exactly(tmp_path: Path) -> None:
    launches = run_chain("single", tmp_path, n_random=0, seed=0, stages=CHAIN_ORDER, shuffle=False)
    print(" ".join(f"{launch.fault or 'finish'}:{launch.seconds:.1f}s" for launch in launches))


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
