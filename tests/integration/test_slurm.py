"""The slurm/ scripts against a real one-node Slurm on localhost (tests/slurm_cluster.py), CPU and gloo.

- train_single_node.sh: 2 processes under torchrun; the job completes, its job folder has the metrics and the
  final checkpoint. Its losses are the reference for the other runs (same world size 2, constant LR).
- preemption: SIGUSR1 to the batch shell of a running job (what --signal=B:USR1@120 does) -> the script
  signals the step -> every rank saves the same step and exits 75 -> the script requeues the job -> the second
  attempt resumes (--resume auto) and ends with the losses of the uninterrupted job, bit for bit.
- train_multi_node.sh: two torchrun agents (one srun task each, 1 process each) meet through the c10d
  rendezvous on the head node; the losses match the single-node job's.
- LAUNCHER=deepspeed: the deepspeed launcher variant (hostfile, no ssh) on one node.
- sweep.sh: two tasks of the job array, each one run, both in one wandb group.
- preflight: a layout that does not fit fails the job before srun, with the reason in its output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.preempt_runs import PREEMPT_ARGS, logged_steps, saved_step, wait_for
from tests.slurm_cluster import PARTITION, SlurmCluster, SlurmUnavailable, install_slurm
from tests.train_runs import step_losses, train_env

pytestmark = pytest.mark.slow

STEPS = 16  # the reference job's length; the preempted job stops after step 3 + the signal's latency
JOB_TIMEOUT = 240
CPU_JOB = [f"--partition={PARTITION}", "--gpus-per-node=0", "--cpus-per-task=2", "--time=10"]
TRAIN = PREEMPT_ARGS + ["--mode", "baseline", "--max-steps", str(STEPS)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        install_slurm()
        c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as err:
        pytest.skip(f"no Slurm here: {err}")
    try:
        c.start()
    except SlurmUnavailable as err:
        c.stop()
        pytest.skip(f"Slurm does not start here: {err}")
    yield c
    c.stop()


def _env(out_dir: Path, **extra: str) -> dict[str, str]:
    return {**train_env(), "OUT_DIR": str(out_dir), "PYTHON": sys.executable, "NPROC_PER_NODE": "2",
            "WANDB_MODE": "disabled", **extra}


def _submit(cluster: SlurmCluster, out_dir: Path, script: str, train_args: list[str], sbatch_args: list[str] = (),
            **env: str) -> tuple[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    job = cluster.sbatch([*CPU_JOB, f"--output={out_dir}/slurm-%j.out", *sbatch_args, f"slurm/{script}",
                          *train_args], _env(out_dir, **env))
    return job, out_dir


def _job_dir(out_dir: Path, job: str, name: str = "gpt2") -> Path:
    return out_dir / f"{name}-{job}"


def _check_completed(cluster: SlurmCluster, job: str, out_dir: Path, restarts: int = 0) -> dict[str, str]:
    fields = cluster.wait_final(job, JOB_TIMEOUT)
    output = "".join(p.read_text()[-3000:] for p in sorted(out_dir.rglob("*.log")) + sorted(out_dir.glob("*.out")))
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", str(restarts)), output
    return fields


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> tuple[str, Path]:
    """train_single_node.sh, uninterrupted: STEPS steps of DDP on 2 processes; (job id, job folder)."""
    job, out = _submit(cluster, tmp_path_factory.mktemp("single"), "train_single_node.sh", TRAIN)
    _check_completed(cluster, job, out)
    return job, _job_dir(out, job)


def test_single_node_job_completes_with_metrics(reference) -> None:
    job, job_dir = reference
    run = job_dir / "attempt-0"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["dp_size"], summary["steps"]) == (2, 2, STEPS)
    assert logged_steps(run) == list(range(1, STEPS + 1))
    assert saved_step(job_dir / "checkpoints") == STEPS
    config = json.loads((run / "config.json").read_text())
    assert config["log"]["wandb_group"] == f"gpt2-{job}"
    assert "preflight: ok: baseline gpt2-tiny: world 2 = 1 nodes x 2" in (job_dir / "batch.log").read_text()


def test_preempted_job_checkpoints_requeues_and_resumes_exactly(cluster, reference, tmp_path: Path) -> None:
    job, out = _submit(cluster, tmp_path, "train_single_node.sh", TRAIN)
    job_dir = _job_dir(out, job)
    first = job_dir / "attempt-0"
    wait_for(lambda: len(logged_steps(first)) >= 3, JOB_TIMEOUT, "step 3 of the first attempt",
             lambda: cluster.state(job)[0] in ("PENDING", "RUNNING"))
    cluster.run(["scancel", "--signal=USR1", "--batch", job])  # what --signal=B:USR1@120 does
    _check_completed(cluster, job, out, restarts=1)

    step = int(next(line for line in (first / "console.log").read_text().splitlines()
                    if "preempted by" in line).split("after step ")[1].split(";")[0])
    assert 3 <= step < STEPS
    assert logged_steps(first)[-1] == step  # stopped at the saved step boundary
    assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == [
        "latest", f"step-{step:06d}", f"step-{STEPS:06d}"]
    batch_log = (job_dir / "batch.log").read_text()
    assert "SIGUSR1" in batch_log and "requeueing" in batch_log and "attempt 1 on" in batch_log
    ref = step_losses(reference[1] / "attempt-0")
    assert step_losses(first) == ref[:step]
    assert step_losses(job_dir / "attempt-1") == ref[step:]  # bit-identical after the resume
    config = json.loads((job_dir / "attempt-1" / "config.json").read_text())
    assert config["checkpoint"]["resumed_from"].endswith(f"step-{step:06d}")


def test_multi_node_two_agents_rendezvous(cluster, reference, tmp_path: Path) -> None:
    """Two srun tasks on the one node stand in for two nodes: two torchrun agents, 1 process each."""
    steps = 4
    job, out = _submit(cluster, tmp_path, "train_multi_node.sh", TRAIN + ["--max-steps", str(steps)],
                       ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"], NPROC_PER_NODE="1")
    _check_completed(cluster, job, out)
    job_dir = _job_dir(out, job)
    assert sorted(p.name for p in job_dir.glob("attempt-0.task-*.log")) == [
        "attempt-0.task-0.log", "attempt-0.task-1.log"]
    summary = json.loads((job_dir / "attempt-0" / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (2, steps)
    assert step_losses(job_dir / "attempt-0") == step_losses(reference[1] / "attempt-0")[:steps]


def test_deepspeed_launcher_variant(cluster, reference, tmp_path: Path) -> None:
    steps = 3
    job, out = _submit(cluster, tmp_path, "train_single_node.sh", TRAIN + ["--max-steps", str(steps)],
                       LAUNCHER="deepspeed", DS_ACCELERATOR="cpu")
    _check_completed(cluster, job, out)
    job_dir = _job_dir(out, job)
    assert "deepspeed.launcher.launch" in (job_dir / "attempt-0.task-0.log").read_text()
    assert step_losses(job_dir / "attempt-0") == step_losses(reference[1] / "attempt-0")[:steps]


def test_sweep_array_runs_one_group(cluster, tmp_path: Path) -> None:
    """Tasks 0 and 1: DDP without fused kernels at the two batch sizes."""
    job, out = _submit(cluster, tmp_path, "sweep.sh", PREEMPT_ARGS + ["--max-steps", "2"],
                       ["--array=0-1", "--cpus-per-task=1"], NPROC_PER_NODE="1", BATCH_SIZES="1 2")
    configs = []
    for task in (0, 1):
        _check_completed(cluster, f"{job}_{task}", out)
        run = _job_dir(out, f"{job}_{task}", "gpt2-sweep") / "attempt-0"
        assert (run / "summary.json").is_file()
        configs.append(json.loads((run / "config.json").read_text()))
    assert [c["train"]["batch_size"] for c in configs] == [1, 2]
    assert [c["train"]["mode"] for c in configs] == ["baseline", "baseline"]
    assert {c["log"]["wandb_group"] for c in configs} == {f"sweep-{job}"}


def test_preflight_fails_the_job_before_srun(cluster, tmp_path: Path) -> None:
    job, out = _submit(cluster, tmp_path, "train_single_node.sh", TRAIN + ["--mode", "single"])
    fields = cluster.wait_final(job, JOB_TIMEOUT)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0")
    batch_out = (out / f"slurm-{job}.out").read_text()
    assert "preflight: error: --mode single was launched on 2 processes" in batch_out
    assert not list(_job_dir(out, job).glob("attempt-0*.log"))  # srun never ran
