"""The GPU benchmark scripts never overwrite an earlier run's log: benchmarks/run_names.sh picks a free name."""

from __future__ import annotations

import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def free_run_name(log_dir: Path, run_dir: Path, name: str) -> str:
    script = f'source "{BENCH / "run_names.sh"}"; free_run_name "$1" "$2" "$3"'
    out = subprocess.run(["bash", "-c", script, "bash", str(log_dir), str(run_dir), name],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def test_free_run_name_skips_existing_logs_and_run_folders(tmp_path: Path) -> None:
    logs, runs = tmp_path, tmp_path / "runs"
    runs.mkdir()
    assert free_run_name(logs, runs, "ddp-b8") == "ddp-b8"
    (logs / "ddp-b8.log").write_text("first run")
    assert free_run_name(logs, runs, "ddp-b8") == "ddp-b8-1"  # the log of the first run is kept
    (runs / "ddp-b8-1").mkdir()  # a run folder without its log (e.g. started by hand) is skipped too
    assert free_run_name(logs, runs, "ddp-b8") == "ddp-b8-2"
    assert free_run_name(logs, logs, "ddp-b8") == "ddp-b8-1"  # gpu_zero3.sh: logs next to the run folders


def test_scripts_naming_runs_pick_a_free_name() -> None:
    # a script that logs to "$name.log" and passes --run-name "$name" must take the name from free_run_name
    scripts = [p for p in BENCH.glob("*.sh") if '--run-name "$name"' in p.read_text()]
    assert {p.name for p in scripts} >= {"gpu_train_runs.sh", "gpu_sweep.sh", "gpu_zero3.sh"}
    for p in scripts:
        assert "free_run_name" in p.read_text(), p
