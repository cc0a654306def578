"""Does a finished torch.profiler window slow the launches after it? Host time per kernel launch before and after
one profiled window, in a fresh process per `TEARDOWN_CUPTI` setting (Kineto reads it when the trace ends).

    python -m benchmarks.profiler_aftereffect [--launches 20000] [--out DIR]

Each process times `--launches` tiny in-place adds on one tensor (host-bound: one kernel launch each, no sync
between), profiles a short burst with CPU and CUDA activities (as `--profile` does), then times the same burst
again. Writes `profiler_aftereffect.csv` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpt2.observe.profiling import CUPTI_TEARDOWN_ENV

SETTINGS = {"unset (Kineto's default: CUPTI stays attached)": None, f"{CUPTI_TEARDOWN_ENV}=1": "1"}
REPEATS = 5  # timed bursts per phase; the median counts


def launch_us(launches: int, device: str) -> float:
    """Median host microseconds per launch over REPEATS bursts of `launches` adds, each burst synchronised."""
    x = torch.zeros(256, device=device)  # [256]: small, so the host bounds the burst
    times = []
    for _ in range(REPEATS):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(launches):
            x.add_(1.0)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / launches * 1e6)
    return sorted(times)[len(times) // 2]


def measure(launches: int, device: str) -> dict[str, float | str]:
    """Launch cost before a profiled window, and after it has ended."""
    launch_us(launches // 10, device)  # warm-up: the allocator, the first launches
    before = launch_us(launches, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities):
        launch_us(launches // 10, device)
    after = launch_us(launches, device)
    return {"before_us": before, "after_us": after, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profiler_aftereffect", description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=20000, help="kernel launches per timed burst")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the tool")
    p.add_argument("--out", type=Path, default=None, help="folder for profiler_aftereffect.csv")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measurement, printed as JSON
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.launches, args.device)))
        return 0
    rows = []
    for label, value in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k != CUPTI_TEARDOWN_ENV}
        if value is not None:
            env[CUPTI_TEARDOWN_ENV] = value
        out = subprocess.run([sys.executable, "-m", "benchmarks.profiler_aftereffect", "--child", "--launches",
                              str(args.launches), "--device", args.device], env=env, check=True,
                             stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]  # stderr shows
        m = json.loads(out)
        rows.append({"setting": label, "device": args.device, "torch": m["torch"], "launches": args.launches,
                     "before_us_per_launch": round(m["before_us"], 2), "after_us_per_launch": round(m["after_us"], 2),
                     "after_over_before": round(m["after_us"] / m["before_us"], 3)})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "profiler_aftereffect.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
    print("| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
