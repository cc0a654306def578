"""The table of simulated ranks (tools.simulate_rank) beside the real one-device runs of the same call.

    python -m benchmarks.simulated_ranks RUN_DIRS... --out DIR [--command TEXT] [--call NAME] [--store [FILE]]

Reads each run folder's summary.json and, where the run was made with --profile, profile_breakdown.json, and writes
DIR/simulated_ranks.csv and .md: per run whether it is simulated, its layout, batch, MFU (for a simulated rank:
this rank's compute with free communication, not the layout's), step time, device busy, device work per kind,
host op time, kernels and collective calls per step, and peak memory beside the planner's prediction. A real run sits
in the table as the comparison; its parity column says that its verdict is not here (a call's parity table gives it,
where the call ran one). --store appends the simulated rows to the results store (marked simulated, no verdict).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from tools import results_store
from tools.common import markdown_table

KINDS = ("gemm", "elementwise/other", "attention", "optimizer", "communication")
COLUMNS = ["run", "simulated", "parity", "layout", "batch", "tokens_per_s", "mfu_pct", "step_ms", "device_busy_pct",
           *(f"{k}_ms" for k in KINDS), "host_op_ms", "kernels", "collective_calls", "peak_gib", "plan_peak_gib",
           "plan_error_pct"]


def layout_of(s: dict[str, Any]) -> str:
    """single | DDP | DeepSpeed ZeRO-3 | FSDP2, with the TP x DP grid and SP."""
    engine = {"single": "single", "baseline": "DDP"}.get(s["mode"]) or (
        "FSDP2" if s.get("zero_engine") == "fsdp2" else "DeepSpeed ZeRO-3")
    grid = f"DP {s['dp_size']} x TP {s['tp_size']}" if s["tp_size"] > 1 else f"DP {s['dp_size']}"
    sp = " + SP" if s.get("sequence_parallel") else ""
    rank = f"rank {s['simulated_rank']} of {s['world_size']}, " if s.get("simulated") else ""
    return f"{engine}{sp} ({rank}{grid})" if s["mode"] != "single" else "single (1 GPU)"


def _round(value: Any, digits: int = 1) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def row(run_dir: Path, s: dict[str, Any]) -> dict[str, Any]:
    """The table's row of the run in `run_dir`, whose summary.json is `s`."""
    profile_file = run_dir / "profile_breakdown.json"
    profile = json.loads(profile_file.read_text()) if profile_file.is_file() else {}
    per_kind = profile.get("ms_per_step", {})
    error = s.get("plan/peak_error")
    return {
        "run": run_dir.name, "simulated": "yes" if s.get("simulated") else "no",
        # a simulated rank trains no function of its layout; a real run's verdict is the call's parity table's
        "parity": "n/a (simulated)" if s.get("simulated") else "none in this table: see the call's parity table",
        "layout": layout_of(s),
        "batch": s["batch_size_per_gpu"], "tokens_per_s": _round(s.get("tokens_per_s"), 0),
        "mfu_pct": _round(100 * s["mfu"]) if s.get("mfu") is not None else None,
        "step_ms": _round(profile.get("step_wall_ms")), "device_busy_pct": profile.get("device_busy_pct"),
        **{f"{k}_ms": _round(per_kind.get(k)) for k in KINDS},
        "host_op_ms": profile.get("host_op_ms_per_step"), "kernels": profile.get("kernels_per_step"),
        "collective_calls": profile.get("collective_calls_per_step"),
        "peak_gib": _round(s.get("mem/peak_allocated_gib"), 2), "plan_peak_gib": _round(s.get("plan/peak_gib"), 2),
        "plan_error_pct": _round(100 * error) if error is not None else None,
    }


def made_on(run_dir: Path) -> str:
    """The device, torch and date of a run, from its own files (the table may be written on another machine)."""
    s = json.loads((run_dir / "summary.json").read_text())
    written = datetime.datetime.fromtimestamp((run_dir / "summary.json").stat().st_mtime, datetime.timezone.utc)
    return f"{s.get('device')} (torch {s.get('torch_version')}), {written:%Y-%m-%dT%H:%MZ}"


def markdown(rows: list[dict[str, Any]], command: str, device: str, commit: str, call: str) -> str:
    shown = [{c: ("" if r[c] is None else r[c]) for c in COLUMNS} for r in rows]
    return "\n".join([
        "# Simulated ranks beside real one-device runs", "",
        f"Device: {device}. Commit: {commit}. Call: {call or 'not named'}. Command: `{command}`.", "",
        "A simulated rank (`simulated: yes`) is one rank of a multi-GPU layout run alone through "
        "parallel/simulated.py: its collectives move nothing. Its memory, device work, host time, kernels and "
        "collective calls are that rank's; its tokens/s and MFU assume free communication and are not the "
        "layout's throughput, and its losses are not the layout's (no parity verdict). Device work per kind sums "
        "kernel durations per step (ms); device busy is the union of kernel intervals over the step's wall time; "
        "plan error is (predicted - measured) / measured peak memory.", "",
        markdown_table(shown, COLUMNS), ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulated_ranks", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with summary.json)")
    p.add_argument("--out", type=Path, required=True, help="folder for simulated_ranks.csv and .md")
    p.add_argument("--command", default="", help="the command that made the runs, for the table's header")
    p.add_argument("--commit", default=None, help="the commit that made the runs (default: this checkout's HEAD)")
    results_store.add_store_arguments(p)
    args = p.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "summary.json").is_file()]
    if missing:
        p.error(f"no summary.json in {', '.join(missing)} (the run failed or is still running)")
    summaries = [json.loads((r / "summary.json").read_text()) for r in args.runs]
    rows = [row(r, s) for r, s in zip(args.runs, summaries)]
    commit = args.commit or results_store.git_commit()
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "simulated_ranks.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "simulated_ranks.md").write_text(
        markdown(rows, args.command, made_on(args.runs[0]), commit, args.call))
    if args.store:
        results_store.append_rows(
            [results_store.row_from_summary(s, call=args.call, raw=args.out / "simulated_ranks.csv", commit=commit)
             for s in summaries if s.get("simulated")], args.store)
    print((args.out / "simulated_ranks.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
