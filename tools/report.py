"""Comparison report of training runs: one Markdown table and four PNG plots, from run folders alone (offline).

    python -m tools.report runs/ddp-b8 runs/zero3-b8 ... [--out report]
    python -m tools.report benchmarks/results/raw/runs          # a folder of run folders works too

A run folder is what train.py writes: metrics.jsonl (one record per log step, then a summary record),
summary.json and config.json. Written to --out: report.md (the table below, plus predicted vs measured
memory when the runs carry the planner's `plan/*` keys), tokens_vs_memory.png (tokens/s against peak
memory, one point per configuration), mfu.png (bars), loss.png (training-loss curves overlaid) and
memory_timeline.png (peak allocated memory at each logged step). The same runs in wandb carry the group,
job type (the configuration label used here) and tags of gpt2.observe.run_logging.wandb_identity.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display
import matplotlib.pyplot as plt  # noqa: E402

from gpt2.config.cli import check_folder_creatable  # noqa: E402
from gpt2.config.schema import ConfigError  # noqa: E402
from gpt2.observe.run_logging import run_label  # noqa: E402
from tools.common import markdown_table  # noqa: E402

COLUMNS = ["Configuration", "Run", "GPUs", "Batch/GPU", "Tokens/s", "MFU", "Peak memory (GiB)", "Training time (s)",
           "Final loss", "Accuracy", "Val loss"]
PLAN_COLUMNS = ["Configuration", "Batch/GPU", "Predicted peak at run time (GiB)", "Measured peak (GiB)", "Error",
                "TP bytes/step predicted", "TP bytes/step measured"]
SIMULATED_NOTE = ("Rows marked SIMULATED are one rank of a multi-GPU layout run alone (tools.simulate_rank): their "
                  "collectives move nothing, so their tokens/s and MFU are not the layout's and their losses carry "
                  "no parity verdict; their memory, device work and host time are that rank's.")
PLOTS = ["tokens_vs_memory.png", "mfu.png", "loss.png", "memory_timeline.png"]


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    steps: list[dict[str, Any]]  # training step records (with a loss), in step order
    config: dict[str, Any]

    @property
    def label(self) -> str:
        s, par = self.summary, self.config.get("parallel", {})
        name = run_label(s["mode"], par.get("zero_stage", 3), s.get("tp_size", 1), par.get("sequence_parallel", False),
                         par.get("zero_engine", "deepspeed"))
        if s.get("fused_kernels", "none") != "none":
            name += f" {s['fused_kernels']}"
        if s.get("compile") not in ("off", False, None):
            name += f" compile-{s['compile']}"
        if s.get("simulated"):  # one rank alone, collectives free: not the layout's throughput
            name += f" [SIMULATED rank {s['simulated_rank']} of {s['world_size']}]"
        return name

    @property
    def name(self) -> str:
        return f"{self.label} b{self.summary['batch_size_per_gpu']}"


def is_run_dir(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "summary.json").is_file()


def find_runs(paths: list[str]) -> list[Path]:
    """Run folders among `paths`; a folder that is not one contributes its run-folder children. A path that gives
    none is named on stderr (a typo would otherwise just shrink the report)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if is_run_dir(p):
            found.append(p)
        elif children := sorted(c for c in p.iterdir() if c.is_dir() and is_run_dir(c)) if p.is_dir() else []:
            found += children
        else:
            print(f"skipped {p}: {'no run folder in it' if p.is_dir() else 'no such folder'} (a run folder holds "
                  "metrics.jsonl or summary.json)", file=sys.stderr)
    return found


class UnreadableRun(ValueError):
    """A run folder whose files cannot be read (a truncated metrics.jsonl, a damaged summary); the message says why."""


SUMMARY_KEYS = ("mode", "world_size", "batch_size_per_gpu")  # what every row of the report's table reads


def _json(path: Path, text: str, where: str = "") -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise UnreadableRun(f"{path}{where} is not valid JSON ({e}): truncated or damaged") from None


def load_run(path: Path) -> Run | None:
    """The run's records; None when it has no summary (it failed or is still running); UnreadableRun when a file
    is damaged."""
    steps, summary = [], None
    if (path / "metrics.jsonl").is_file():
        for number, line in enumerate((path / "metrics.jsonl").read_text(errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            record = _json(path / "metrics.jsonl", line, f" line {number}")
            if record.get("type") == "summary":
                summary = record
            elif record.get("type") == "step" and record.get("loss") is not None:
                steps.append(record)
    if summary is None and (path / "summary.json").is_file():
        summary = _json(path / "summary.json", (path / "summary.json").read_text(errors="replace"))
    if summary is None:
        return None
    config = (_json(path / "config.json", (path / "config.json").read_text(errors="replace"))
              if (path / "config.json").is_file() else {})
    latest = {r["step"]: r for r in steps}  # a resumed run logs its steps again: keep the latest record
    return Run(path, summary, [latest[k] for k in sorted(latest)], config)


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{suffix}"


def table_row(run: Run) -> dict[str, str]:
    s = run.summary
    return {
        "Configuration": run.label, "Run": run.path.name, "GPUs": str(s["world_size"]),
        "Batch/GPU": str(s["batch_size_per_gpu"]),
        "Tokens/s": _fmt(s.get("tokens_per_s"), ",.0f"), "MFU": _fmt(s.get("mfu"), ".1f", 100, "%"),
        "Peak memory (GiB)": _fmt(s.get("mem/peak_allocated_gib"), ".2f"),
        "Training time (s)": _fmt(s.get("train_time_s"), ".1f"), "Final loss": _fmt(s.get("final_loss"), ".4f"),
        "Accuracy": _fmt(s.get("final_accuracy"), ".4f"), "Val loss": _fmt(s.get("val_loss"), ".4f"),
    }


def plan_row(run: Run) -> dict[str, str]:
    s = run.summary
    return {
        "Configuration": run.label, "Batch/GPU": str(s["batch_size_per_gpu"]),
        "Predicted peak at run time (GiB)": _fmt(s.get("plan/peak_gib"), ".2f"),
        "Measured peak (GiB)": _fmt(s.get("plan/measured_peak_gib"), ".2f"),
        "Error": _fmt(s.get("plan/peak_error"), "+.1f", 100, "%"),
        "TP bytes/step predicted": _fmt(s.get("plan/tp_payload_bytes") if s.get("tp_size", 1) > 1 else None, ",.0f"),
        "TP bytes/step measured": _fmt(s.get("plan/measured_tp_payload_bytes"), ",.0f"),
    }


def markdown(runs: list[Run]) -> str:
    first = runs[0].summary
    lines = ["# Training runs", "",
             f"{first.get('model')}, seq {first.get('seq_len')}, {first.get('precision')} on {first.get('device')} "
             f"(torch {first.get('torch_version')}); tokens/s and MFU exclude the throughput warm-up steps; "
             f"MFU = model FLOPs/s / (GPUs x {first.get('peak_tflops_per_gpu')} TFLOP/s); peak memory is the "
             "allocator's peak allocated, max over ranks.", "",
             *([SIMULATED_NOTE, ""] if any(r.summary.get("simulated") for r in runs) else []),
             markdown_table([table_row(r) for r in runs], COLUMNS)]
    planned = [r for r in runs if "plan/peak_gib" in r.summary]
    if planned:
        lines += ["", "## Planner: predicted vs measured (gpt2.planning.planner)", "",
                  markdown_table([plan_row(r) for r in planned], PLAN_COLUMNS)]
    lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def plot(runs: list[Run], out: Path) -> list[Path]:
    paths = [out / p for p in PLOTS]
    names = [r.name for r in runs]

    fig, ax = plt.subplots(figsize=(7, 5))
    for r, name in zip(runs, names):
        tok, mem = r.summary.get("tokens_per_s"), r.summary.get("mem/peak_allocated_gib")
        if tok is not None and mem is not None:
            ax.scatter(mem, tok)
            ax.annotate(name, (mem, tok), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="peak allocated memory per GPU (GiB)", ylabel="tokens/s (all GPUs)",
           title="Throughput vs memory")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(runs)), 4.5))
    mfu = [100 * (r.summary.get("mfu") or 0.0) for r in runs]
    bars = ax.bar(range(len(runs)), mfu)
    ax.bar_label(bars, labels=[f"{m:.1f}%" if r.summary.get("mfu") is not None else "n/a"
                               for m, r in zip(mfu, runs)], fontsize=8)
    ax.set_xticks(range(len(runs)), names, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="MFU (%)", title="Model FLOPs utilisation")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)

    for path, key, ylabel, title in ((paths[2], "loss", "training loss", "Loss curves"),
                                     (paths[3], "mem/peak_allocated_gib", "peak allocated (GiB)",
                                      "Memory timeline (allocator peak so far, per logged step)")):
        fig, ax = plt.subplots(figsize=(7, 5))
        for r, name in zip(runs, names):
            points = [(s["step"], s[key]) for s in r.steps if s.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker=".", label=name)
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders, or folders of run folders")
    parser.add_argument("--out", default="report", help="folder for report.md and the PNGs")
    args = parser.parse_args(argv)
    try:  # before reading any run: a file in the way failed only at the end
        check_folder_creatable("--out", Path(args.out))
    except ConfigError as err:
        parser.error(str(err))
    runs = []
    # a run named twice is one row; one bad folder is named and skipped, the others still make the report
    for folder in dict.fromkeys(p.resolve() for p in find_runs(args.runs)):
        try:
            run = load_run(folder)
        except UnreadableRun as why:
            print(f"skipped {folder}: {why}", file=sys.stderr)
            continue
        if run is None:
            print(f"skipped {folder}: no summary record (failed or unfinished run)", file=sys.stderr)
        elif missing := [key for key in SUMMARY_KEYS if key not in run.summary]:
            print(f"skipped {folder}: its summary lacks {', '.join(missing)}: not a train.py run folder?",
                  file=sys.stderr)
        else:
            runs.append(run)
    if not runs:
        print("no run folder with a summary record", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(runs)
    (out / "report.md").write_text(text)
    plot(runs, out)
    print(text)
    print(f"written: {out / 'report.md'} and {', '.join(PLOTS)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
