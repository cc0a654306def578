"""A chain of launches of one run (2-rank torchrun; `single`: one process), each killed by one fault and continued by
the next with `--resume auto` (tests/integration/test_faults.py, test_faults_ddp.py, test_faults_zero3.py).

Each launch is both the resume check of the previous fault and the next fault, so one launch per fault: a kill at
one stage of a save (`GPT2_TEST_KILL_AT=STAGE@STEP`, the step the launch saves first) or a SIGKILL at a random
instant after the launch logged its first step (inside a step, a save or a prune). A random kill is either

- "job": every process of the launch (torchrun and both ranks) at once, as when a node dies or a scheduler kills
  the job's cgroup, or
- "rank": one rank (drawn at random), as the kernel's OOM killer picks one process; torchrun then stops the
  other rank (SIGTERM, which the run takes as a preemption request it never gets to honour: its peer is gone).

After every kill: each complete-looking `step-XXXXXX` folder passes its manifest check (nothing half-written can
be picked), and the next launch resumes from the newest one (for a stage kill at step k: k - 1 before the rename,
k from the rename on). Every step any launch logged equals the uninterrupted run's (loss and grad norm, 1e-6 for 2
ranks; bit for bit in one process), and the last launch, unfaulted, finishes the run with `latest` and the last
checkpoint only.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpt2.train import checkpoint
from gpt2.train.checkpoint import FAULT_ENV, SAVE_STAGES
from tests.train_runs import (
    ROOT,
    TINY_ARGS,
    forked_launch,
    forking,
    read_killed_records,
    run_train,
    step_values,
    train_command,
    train_env,
)

BEFORE_RENAME = SAVE_STAGES[:SAVE_STAGES.index("renamed")]
PRUNE_STAGES = ("prune-renamed", "prune-partial")  # reached only when --keep-last deletes an older checkpoint
# the stages of the ZeRO-3 chains: the two around the engine's own writes (engine.save_state runs between them, on
# every rank) and the end of a save (so a later launch loads the engine's checkpoint, whatever the random kills do).
# The other 9 are rank 0's prepare and commit (gpt2.train.checkpoint.save_checkpoint), the same code and files for
# every engine and world size: the single-process chain (tests/integration/test_faults.py) kills at every stage.
ENGINE_STAGES = ("rank-state-written", "model-state-written", "pruned")
# the DDP chain's: those, rank 0 dying in its prepare (tmp-created) while the other rank waits, and the commit's two
# that decide the resume point (pending-written, the last before the rename: every file written, `latest.pending`
# naming an unrenamed folder; renamed: a complete folder that only `latest.pending` names, which every rank must
# resume from). The commit's other 6 leave rank 0's files as the single-process chain's do, the other rank waiting
# at the same barrier.
DDP_STAGES = ("tmp-created", "rank-state-written", "model-state-written", "pending-written", "renamed", "pruned")
FLAGS = {"single": ["--mode", "single"], "ddp": ["--mode", "baseline"],
         "zero3": ["--mode", "hybrid", "--zero-stage", "3"], "fsdp2": ["--mode", "hybrid", "--zero-engine", "fsdp2"]}
STEPS = 12  # 12 stage kills advance the run 5 steps (6 if the prunes come first), a random one about 0.6 (at most 2):
# 2 of them, 10 at most
RANDOM_WINDOW_S = 0.4  # a random kill comes 0-0.4 s after the launch's first step record: 1-2 steps and saves


def kill_delays(n: int, rng: random.Random, window: float = RANDOM_WINDOW_S) -> list[float]:
    """`n` instants in [0, window), the i-th drawn from the i-th of n equal slices, in random order: however few the
    kills, they spread over the window (inside a step, a save, a prune) instead of clustering by chance."""
    delays = [rng.uniform(i * window / n, (i + 1) * window / n) for i in range(n)]
    rng.shuffle(delays)
    return delays


def chain_args(name: str) -> list[str]:
    return TINY_ARGS + FLAGS[name] + ["--data", "synthetic", "--max-steps", str(STEPS), "--seed", "7",
                                      "--batch-size", "2", "--eval-batches", "1", "--save-interval", "1",
                                      "--keep-last", "1"]


@dataclass
class Launch:
    fault: str  # a stage name, "job" or "rank" (random instants), "" for the last, unfaulted launch
    run_dir: Path
    returncode: int = 0
    seconds: float = 0.0


def _newest_complete(ck: Path) -> int:
    """Check every complete-looking step folder against its manifest; the newest one's step (0: none)."""
    found = checkpoint.list_checkpoints(ck)
    for _, folder in found:
        checkpoint._verified.discard(folder.resolve())  # folders come and go between launches: check afresh
        checkpoint.verify_checkpoint(folder)
    return found[-1][0] if found else 0


def _start_of(run_dir: Path) -> int:
    resumed = json.loads((run_dir / "config.json").read_text())["checkpoint"]["resumed_from"]
    return checkpoint._step_of(Path(resumed)) if resumed else 0


def _kill_at_random(proc: subprocess.Popen, run_dir: Path, kind: str, delay: float, rng: random.Random) -> str:
    """SIGKILL the job or one rank `delay` seconds after the launch's first step record; what was killed ("" if the
    launch ended first)."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.is_file() and '"type": "step"' in path.read_text():
            break
        time.sleep(0.02)
    time.sleep(delay)
    workers = psutil.Process(proc.pid).children() if proc.poll() is None else []
    if len(workers) != 2:
        return ""
    if kind == "rank":
        rank = rng.randrange(2)
        workers = [w for w in workers if w.environ().get("RANK") == str(rank)]
        kind = f"rank {rank}"
    else:
        workers.append(psutil.Process(proc.pid))
    for p in workers:
        p.send_signal(signal.SIGKILL)
    return kind


def run_chain(name: str, tmp: Path, n_random: int, seed: int, stages: tuple[str, ...] = SAVE_STAGES,
              shuffle: bool = True) -> list[Launch]:
    """The uninterrupted run, then the chain: each of `stages` (default: every stage of SAVE_STAGES) once and
    `n_random` random kills (2 ranks only: half of the whole job, half of one rank; instants spread over the window by
    `kill_delays`), in a seeded random order (`shuffle`) or as given, then a launch that finishes. Returns the
    launches (for timing and messages)."""
    nproc = 1 if name == "single" else 2
    tol = 0.0 if nproc == 1 else 1e-6  # one process: no reduction order to differ
    args = chain_args(name)
    run_train(args + ["--run-name", "full", "--save-dir", str(tmp / "ck-full")], tmp, nproc=nproc)
    reference = {key: step_values(tmp / "full", key) for key in ("loss", "grad_norm")}
    assert len(reference["loss"]) == STEPS

    rng = random.Random(seed)
    faults = list(stages) + [("job", "rank")[i % 2] for i in range(n_random)]
    if shuffle:
        rng.shuffle(faults)
    delays = iter(kill_delays(n_random, rng))
    ck, out = tmp / "ck", tmp / "runs"
    launches: list[Launch] = []
    start = 0
    for i, fault in enumerate(faults + [""]):
        run_dir = out / f"L{i:02d}-{fault or 'finish'}"
        env = train_env()
        if fault in SAVE_STAGES:  # the first save this launch makes; a prune needs an older checkpoint
            env[FAULT_ENV] = f"{fault}@{start + 2 if fault in PRUNE_STAGES and start == 0 else start + 1}"
        train_args = [*args, "--save-dir", str(ck), "--resume", "auto", "--out-dir", str(out), "--run-name",
                      run_dir.name]
        launch = Launch(fault, run_dir)
        launches.append(launch)
        had_latest = (ck / checkpoint.LATEST).is_file()
        t0 = time.monotonic()
        if nproc == 1 and fault not in ("job", "rank") and forking():  # the process kills itself (FAULT_ENV)
            faulted = {FAULT_ENV: env[FAULT_ENV]} if FAULT_ENV in env else {}
            launch.returncode = forked_launch(train_args, tmp / f"{run_dir.name}.log", faulted)
            assert launch.returncode is not None, f"{run_dir.name} timed out"
        else:
            with open(tmp / f"{run_dir.name}.log", "w") as log_file:
                proc = subprocess.Popen([*train_command(nproc), *train_args], env=env, cwd=ROOT, stdout=log_file,
                                        stderr=subprocess.STDOUT)
                try:
                    if fault in ("job", "rank"):
                        launch.fault = _kill_at_random(proc, run_dir, fault, next(delays), rng)
                    launch.returncode = proc.wait(timeout=300)
                finally:
                    if proc.poll() is None:
                        proc.kill()
        launch.seconds = time.monotonic() - t0
        log_text = (tmp / f"{run_dir.name}.log").read_text()  # torchrun's and both ranks' output
        log_tail = log_text[-4000:]
        assert launch.fault or not fault, f"{run_dir.name} ended (rc {launch.returncode}) before its kill\n{log_tail}"
        if not fault:
            assert launch.returncode == 0, f"{run_dir.name}: rc {launch.returncode}\n{log_tail}"
        else:
            assert launch.returncode != 0, f"{run_dir.name} was not killed\n{log_tail}"
        assert (run_dir / "config.json").is_file(), f"{run_dir.name} never started training\n{log_tail}"
        assert _start_of(run_dir) == start, f"{run_dir.name} resumed from {_start_of(run_dir)}, not {start}"
        if launches[-2:-1] and launches[-2].fault == "renamed":  # `latest.pending` named the newer checkpoint
            # (before any `latest` was written, the warning says there is none yet)
            newer = "resuming from the newer" if had_latest else "before writing it): resuming from"
            assert f"{newer} {checkpoint.step_dir_name(start)}" in log_text, run_dir.name

        records = [r for r in read_killed_records(run_dir) if r["type"] == "step" and "loss" in r]
        assert records and records[0]["step"] == start + 1, (run_dir.name, records[:1])
        for r in records:
            for key, want in reference.items():
                assert abs(r[key] - want[r["step"] - 1]) <= tol, (run_dir.name, r["step"], key, r[key])

        newest = _newest_complete(ck)
        if fault in SAVE_STAGES:  # killed at the save of step start + 1 (start + 2: the first prune of a run)
            killed_at = int(env[FAULT_ENV].split("@")[1])
            assert records[-1]["step"] == killed_at, (run_dir.name, records[-1]["step"])
            assert newest == (killed_at - 1 if fault in BEFORE_RENAME else killed_at), (run_dir.name, newest)
        start = newest
        assert fault == "" or start < STEPS, f"{run_dir.name}: the run reached --max-steps with faults left"

    assert start == STEPS
    assert sorted(p.name for p in ck.iterdir()) == ["latest", f"step-{STEPS:06d}"]
    logged = {r["step"] for launch in launches for r in read_killed_records(launch.run_dir) if r["type"] == "step"}
    assert logged == set(range(1, STEPS + 1))
    return launches
