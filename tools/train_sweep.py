"""The training mode matrix on N GPUs: one torchrun launch per configuration, one table at the end.

    python -m tools.train_sweep --gpus 4 --out benchmarks/results/sweep                  # the full matrix
    python -m tools.train_sweep --gpus 4 --modes baseline hybrid --fused none --batches 8 --dry-run
    python -m tools.train_sweep --gpus 4 --modes hybrid-tp2 --batches 8 max --extra-args="--compile"
    python -m tools.train_sweep --gpus 4 --parity benchmarks/results/parity/4xh200/parity.csv   # gated tables

Modes (train.py flags): single (--gpus 1 only), baseline (DDP), zero1 / zero2, hybrid (ZeRO-3), hybrid-deepcompile
(ZeRO-3 under DeepSpeed's DeepCompile: --compile --compiler deepcompile), hybrid-tp2 (ZeRO-3 + TP 2), hybrid-tp2-sp (+
sequence parallelism), hybrid-block / hybrid-tp2-block / hybrid-tp2-sp-block (the same three with `--zero3-fetch
block --zero3-unit-blocks 1`, ZeRO-3's gather before flat 4-block units became the default; a row whose ZeRO-3 gather
is not the default, by its mode or --extra-args, names it: "ZeRO-3 (block, 1-block units)"), fsdp2 / fsdp2-tp2 /
fsdp2-tp2-sp (ZeRO-3 by PyTorch FSDP2, `--zero-engine fsdp2`, without and with TP 2, +- sequence parallelism), and
the reference rows hf-ddp / hf-zero3 (`tools.hf_reference`: Hugging Face GPT-2 as users run it). Each of our modes
runs with every `--fused` backend; the HF rows have no fused kernels. `--batches` takes micro-batch sizes per GPU
and `max`: the largest of `--max-batches` (tried in descending order) that completes without running out of CUDA
memory; sizes at or above one that already ran out are not tried, nor, on a GPU host, train.py sizes whose planned
peak (train.py's plan) does not fit in the GPU's memory (printed as skipped; an OOM under TP collectives can hang
until the run's timeout instead of failing).

Every run: `python -m torch.distributed.run --standalone --nproc_per_node=N train.py ...` (or `-m
tools.hf_reference`), `--max-steps` steps of which the first `--warmup` are excluded from tokens/s and
MFU (with `--extra-args=--profile`, also the profiled steps after them, `gpt2.config.schema.PROFILED_STEPS`: each
row
then gets the device's busy share and the kernels launched per step), its output in OUT/logs/NAME.log and its run
folder in OUT/runs/NAME. A run that fails, runs out of memory or passes `--run-timeout` is recorded with its last
error line and the sweep goes on. After every run OUT/sweep.csv (every launch) and OUT/sweep.md (status table:
configuration, kernels, batch/GPU, tokens/s, MFU, peak memory, step and run time, failures with their last error
line) are rewritten, and so are
`tools.report`'s report.md and plots (tokens_vs_memory.png, mfu.png, loss.png, memory_timeline.png) over
the runs that finished, so an interrupted sweep still leaves its tables. `--include RUN_DIR...` adds runs
made elsewhere (e.g. the reference runs of benchmarks/gpu_sweep.sh).

No speed without parity: `--parity PARITY.csv...` (written by `python -m tools.parity`) gives every row the
loss-parity verdict of its configuration (same model, layout and world size, kernels, attention, compile scope,
activation checkpointing and precision: tools/parity_verdict.py `config_key`), in a `parity` column of
sweep.csv and sweep.md; report.md and its plots then keep only the runs that pass (and the Hugging Face
reference runs, which are not train.py's). Without --parity every row reads `unchecked`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.numa.binding import AffinityMode

from gpt2.config.cli import parse_args as parse_train_args
from gpt2.config.layout import RunLayout
from gpt2.config.schema import (
    MODEL_PRESETS,
    PROFILED_STEPS,
    ZERO3_UNIT_BLOCKS,
    ConfigError,
    non_negative_int,
    positive_int,
)
from gpt2.planning import planner
from tools import report, results_store
from tools.common import (
    ROOT,
    free_run_name,
    last_error,
    launch,
    markdown_table,
    stop_launches_on_signal,
    torchrun,
    write_csv,
)
from tools.parity_matrix import PER_BLOCK
from tools.parity_verdict import read_verdicts, verdict_of


@dataclass(frozen=True)
class Mode:
    label: str
    flags: tuple[str, ...]
    module: str | None = None  # None: train.py; else the benchmark module launched with -m
    takes_fused: bool = True


def zero3_gather_suffix(fetch: str | None, unit_blocks: int | None) -> str:
    """How DeepSpeed ZeRO-3 gathers where not by its default (flat tensors in units of ZERO3_UNIT_BLOCKS), as a
    label's suffix: ' (block, 1-block units)'; '' for the default, or where the run does not say (None)."""
    parts = [fetch] if fetch not in (None, "flat") else []
    if unit_blocks and unit_blocks != ZERO3_UNIT_BLOCKS:
        parts.append(f"{unit_blocks}-block units")
    return f" ({', '.join(parts)})" if parts else ""


def flag_value(flags: tuple[str, ...], flag: str) -> str | None:
    return flags[flags.index(flag) + 1] if flag in flags else None


MODES: dict[str, Mode] = {
    "single": Mode("single", ("--mode", "single")),  # under torchrun too: world size 1, the reference of --gpus 1
    "baseline": Mode("DDP", ("--mode", "baseline")),
    "zero1": Mode("ZeRO-1", ("--mode", "hybrid", "--zero-stage", "1")),
    "zero2": Mode("ZeRO-2", ("--mode", "hybrid", "--zero-stage", "2")),
    "hybrid": Mode("ZeRO-3", ("--mode", "hybrid")),
    "hybrid-deepcompile": Mode("ZeRO-3 DeepCompile", ("--mode", "hybrid", "--compile", "--compiler", "deepcompile")),
    "hybrid-tp2": Mode("ZeRO-3 + TP2", ("--mode", "hybrid", "--tp-size", "2")),
    "hybrid-tp2-sp": Mode("ZeRO-3 + TP2 + SP", ("--mode", "hybrid", "--tp-size", "2", "--sequence-parallel")),
    # the same three gathering each block's own parameters, one block a leaf (gpt2.runtime.parallelize): their own
    # modes, so one sweep times both gathers (--extra-args applies to every mode, DDP's included)
    "hybrid-block": Mode("ZeRO-3", ("--mode", "hybrid", *PER_BLOCK)),
    "hybrid-tp2-block": Mode("ZeRO-3 + TP2", ("--mode", "hybrid", "--tp-size", "2", *PER_BLOCK)),
    "hybrid-tp2-sp-block": Mode("ZeRO-3 + TP2 + SP", ("--mode", "hybrid", "--tp-size", "2", "--sequence-parallel",
                                                      *PER_BLOCK)),
    "fsdp2": Mode("FSDP2", ("--mode", "hybrid", "--zero-engine", "fsdp2")),  # ZeRO-3 by PyTorch FSDP2
    "fsdp2-tp2": Mode("FSDP2 + TP2", ("--mode", "hybrid", "--zero-engine", "fsdp2", "--tp-size", "2")),
    "fsdp2-tp2-sp": Mode("FSDP2 + TP2 + SP", ("--mode", "hybrid", "--zero-engine", "fsdp2", "--tp-size", "2",
                                              "--sequence-parallel")),
    "hf-ddp": Mode("HF transformers DDP", ("--mode", "ddp"), "tools.hf_reference", takes_fused=False),
    "hf-zero3": Mode("HF transformers ZeRO-3", ("--mode", "zero3"), "tools.hf_reference", takes_fused=False),
}
OOM_PATTERNS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
MIN_RUN_S = 60.0  # under --budget-s, a run with less time left than this could only be killed: not launched


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=positive_int, default=4, help="processes per run (--nproc_per_node)")
    p.add_argument("--numa-binding", choices=[mode.value for mode in AffinityMode],
                   help="torchrun's --numa-binding for every run (torch >= 2.9, GPU hosts): each rank's CPUs near its "
                        "GPU; the cores a run could use are in its host_cpu column")
    p.add_argument("--model", default="gpt2-large", choices=list(MODEL_PRESETS))
    p.add_argument("--seq-len", type=positive_int, default=1024)
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps per run (--max-steps)")
    p.add_argument("--warmup", type=non_negative_int, default=10, help="steps excluded from tokens/s and MFU")
    p.add_argument("--log-interval", type=positive_int, default=5)
    p.add_argument("--modes", nargs="+", default=["baseline", "hybrid", "hybrid-tp2", "hf-ddp", "hf-zero3"],
                   choices=list(MODES))
    p.add_argument("--fused", nargs="+", default=["none", "triton"], choices=["none", "triton", "cuda"])
    p.add_argument("--batches", nargs="+", default=["8", "max"], help="micro-batch sizes per GPU and/or 'max'")
    p.add_argument("--max-batches", type=int, nargs="+", default=[64, 48, 32, 24, 16],
                   help="candidates for 'max', tried largest first")
    p.add_argument("--data", choices=["synthetic", "wikitext"], default="synthetic", help="train.py runs only")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--peak-tflops", type=float, default=None, help="passed on (MFU on an unlisted device / CPU)")
    p.add_argument("--extra-args", default="", help="more train.py flags, one string, e.g. --extra-args='--compile'")
    p.add_argument("--out", default="benchmarks/results/sweep")
    p.add_argument("--include", nargs="*", default=[], help="existing run folders to add to the table")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds per run before it is killed")
    p.add_argument("--budget-s", type=float, default=0.0, help="stop launching runs after this many seconds (0: no)")
    p.add_argument("--wandb", choices=["online", "offline", "disabled"], default="disabled")
    p.add_argument("--wandb-group", default=None, help="default: sweep-<date-time>")
    p.add_argument("--parity", type=Path, nargs="+",
                   help="parity.csv files of tools.parity: every row gets the verdict of its configuration, and "
                        "report.md and its plots keep only the runs that pass")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    results_store.add_store_arguments(p)
    args = p.parse_args(argv)
    for b in args.batches:
        if b != "max" and not (b.isdigit() and int(b) > 0):
            p.error(f"--batches takes positive integers or 'max', not {b!r}")
    if "--profile" in shlex.split(args.extra_args) and args.steps <= args.warmup + PROFILED_STEPS:
        p.error(f"--extra-args=--profile leaves the {PROFILED_STEPS} steps after --warmup {args.warmup} out of "
                f"tokens/s too: raise --steps above {args.warmup + PROFILED_STEPS}")
    missing = [str(path) for path in args.parity or [] if not path.is_file()]
    if missing:  # before any run: a sweep without its verdicts publishes nothing
        p.error(f"--parity {' '.join(missing)}: no such file; run python -m tools.parity first (its --out "
                "folder holds parity.csv)")
    if "single" in args.modes and args.gpus != 1:
        p.error(f"--modes single runs on one GPU; drop it or pass --gpus 1 (not {args.gpus})")
    args.wandb_group = args.wandb_group or time.strftime("sweep-%Y%m%d-%H%M%S")
    return args


@dataclass
class RunResult:
    mode: str
    fused: str
    batch: int
    batch_choice: str  # "fixed" or "max"
    name: str
    status: str  # ok | oom | failed | timeout | skipped
    error: str = ""
    wall_s: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def run_args(args: argparse.Namespace, mode: str, fused: str, batch: int, name: str) -> list[str]:
    """The arguments of one run (train.py's, or the reference module's), without the launcher."""
    m = MODES[mode]
    cmd = [*m.flags, "--model", args.model, "--seq-len", str(args.seq_len), "--batch-size", str(batch),
           "--max-steps", str(args.steps), "--throughput-warmup-steps", str(args.warmup),
           "--log-interval", str(args.log_interval), "--precision", args.precision,
           "--out-dir", str(Path(args.out).resolve() / "runs"), "--run-name", name,
           "--wandb", args.wandb, "--wandb-group", args.wandb_group]
    if args.device:
        cmd += ["--device", args.device]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    if not m.module:  # no evaluation: a speed row needs none, and its compile could outlast --run-timeout
        cmd += ["--fused-kernels", fused, "--data", args.data, "--eval-batches", "0", *shlex.split(args.extra_args)]
    return cmd


def command(args: argparse.Namespace, mode: str, fused: str, batch: int, name: str) -> list[str]:
    m = MODES[mode]
    target = ["-m", m.module] if m.module else [str(ROOT / "train.py")]
    return [*torchrun(args.gpus, args.numa_binding), *target, *run_args(args, mode, fused, batch, name)]


def planned(args: argparse.Namespace, mode: str, fused: str, batch: int) -> planner.Plan | None:
    """train.py's plan of a run on this host's GPUs (what its start-up prints); None for the reference modes (not
    train.py), without a GPU, and for flags train.py refuses (the run is launched and fails with train.py's own
    message, as a row of the sweep)."""
    if MODES[mode].module or not torch.cuda.is_available() or args.device == "cpu":
        return None
    try:
        layout = RunLayout.resolve(parse_train_args(run_args(args, mode, fused, batch, "plan")), args.gpus, "cuda")
    except (ConfigError, SystemExit):  # SystemExit: argparse's own refusals
        return None
    return planner.make_plan(layout, planner.device_memory_gib(None))


def run_name(mode: str, fused: str, batch: int) -> str:
    return f"{mode}-b{batch}" if not MODES[mode].takes_fused else f"{mode}-{fused}-b{batch}"


def read_run(run_dir: Path) -> dict[str, Any]:
    """summary.json (and the sequence-parallel flag from config.json) of a run folder, {} if it has none."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return {}
    summary = json.loads(summary_path.read_text())
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    summary["sequence_parallel"] = config.get("parallel", {}).get("sequence_parallel", False)
    return summary


class Sweep:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.results: list[RunResult] = []
        self.start = time.perf_counter()

    def run(self, mode: str, fused: str, batch: int, choice: str) -> RunResult:
        args = self.args
        name = free_run_name(self.out, run_name(mode, fused, batch))
        cmd = command(args, mode, fused, batch, name)
        result = RunResult(mode, fused, batch, choice, name, "skipped")
        remaining = args.budget_s - (time.perf_counter() - self.start) if args.budget_s else args.run_timeout
        if remaining < min(MIN_RUN_S, args.run_timeout):
            result.error = "time budget spent"
        else:
            log_path = self.out / "logs" / f"{name}.log"
            rc, result.wall_s = launch(cmd, log_path, min(args.run_timeout, remaining))
            log = log_path.read_text(errors="replace")
            result.summary = read_run(self.out / "runs" / name)
            if rc is None:
                result.status, result.error = "timeout", f"killed after {result.wall_s:.0f} s"
            elif any(p in log for p in OOM_PATTERNS):
                result.status, result.error = "oom", last_error(log)
            elif rc != 0:
                result.status, result.error = "failed", f"exit {rc}: {last_error(log)}"
            elif not result.summary:
                result.status, result.error = "failed", "exit 0 but no summary.json"
            else:
                result.status = "ok"
        self.results.append(result)
        print(f"[{time.perf_counter() - self.start:6.0f}s] {name}: {result.status} "
              f"{format_row(table_row(result))} {result.error}", flush=True)
        return result

    def run_point(self, mode: str, fused: str, batch_spec: str) -> None:
        """One fixed batch, or the descending search for the largest that fits."""
        same = [r for r in self.results if (r.mode, r.fused) == (mode, fused)]
        if batch_spec != "max":
            self.run(mode, fused, int(batch_spec), "fixed")
            return
        ran_out = [r.batch for r in same if r.status == "oom"]
        for batch in sorted(self.args.max_batches, reverse=True):
            if ran_out and batch >= min(ran_out):
                continue
            done = next((r for r in same if r.batch == batch and r.status == "ok"), None)
            if done is not None:  # already measured as a fixed size: it is also the largest that fits
                self.results.append(RunResult(**{**done.__dict__, "batch_choice": "max"}))
                return
            plan = planned(self.args, mode, fused, batch)
            if plan is not None and not plan.fits:  # an OOM with TP collectives can hang, not fail
                peak = plan.memory.peak / planner.GIB
                print(f"{run_name(mode, fused, batch)}: skipped, the planner's peak {peak:.1f} GiB does not fit in "
                      f"{plan.usable_gib:.1f} GiB", flush=True)
                continue
            result = self.run(mode, fused, batch, "max")
            if result.status != "oom":
                return

    def points(self) -> list[tuple[str, str, str]]:
        """Batch sizes outermost, then kernels, then modes: under --budget-s every mode gets its first size."""
        return [(mode, fused, b) for b in self.args.batches for fused in self.args.fused for mode in self.args.modes
                if MODES[mode].takes_fused or fused == self.args.fused[0]]


def table_row(r: RunResult) -> dict[str, Any]:
    s = r.summary
    mode = MODES.get(r.mode)
    # how ZeRO-3 gathered: the run's own record, else (no summary: failed, killed) what its mode asks for
    if "zero3_fetch" in s:
        gather = s["zero3_fetch"], s.get("zero3_unit_blocks")
    else:
        flags = mode.flags if mode else ()
        unit = flag_value(flags, "--zero3-unit-blocks")
        gather = flag_value(flags, "--zero3-fetch"), int(unit) if unit else None
    label = (mode.label if mode else r.mode) + zero3_gather_suffix(*gather)
    if s.get("fsdp2_params") == "tensors":  # FSDP2 over its own tensors, not its default flat unit tensors
        label += " (tensors)"
    return {
        "configuration": label, "fused_kernels": r.fused if not mode or mode.takes_fused
        else "-", "batch_per_gpu": r.batch, "batch_choice": r.batch_choice, "gpus": s.get("world_size"),
        "tokens_per_s": s.get("tokens_per_s"), "tokens_per_s_per_gpu": s.get("tokens_per_s_per_gpu"),
        "mfu": s.get("mfu"), "peak_allocated_gib": s.get("mem/peak_allocated_gib"),
        "peak_reserved_gib": s.get("mem/peak_reserved_gib"),
        "allocated_after_step_gib": s.get("mem/allocated_after_step_gib"), "step_time_s": s.get("step_time_s"),
        "run_time_s": r.wall_s, "final_loss": s.get("final_loss"),
        # --extra-args=--profile: the device's busy share of the profiled steps, and what the host did per step
        "device_busy_pct": s.get("profile/device_busy_pct"),
        "host_op_ms_per_step": s.get("profile/host_op_ms_per_step"),
        "kernels_per_step": s.get("profile/kernels_per_step"),
        "collective_calls_per_step": s.get("profile/collective_calls_per_step"),
        "status": r.status, "error": r.error,
        "run": r.name, "mode": r.mode, "device": s.get("device"), "host_cpu": s.get("host_cpu"),
        "compile_wrapper": s.get("compile_wrapper"), "zero3_fetch": s.get("zero3_fetch"),
        "zero3_unit_blocks": s.get("zero3_unit_blocks"), "fsdp2_unit_blocks": s.get("fsdp2_unit_blocks"),
        "fsdp2_gather": s.get("fsdp2_gather"), "fsdp2_forward_prefetch": s.get("fsdp2_forward_prefetch"),
        "fsdp2_params": s.get("fsdp2_params"),
    }


def included_row(run_dir: Path) -> dict[str, Any] | None:
    """A table row for a run folder made elsewhere; its mode key is rebuilt from the summary and config."""
    s = read_run(run_dir)
    if not s:
        print(f"--include {run_dir}: no summary.json, left out", file=sys.stderr)
        return None
    tp = f"-tp{s['tp_size']}" if s.get("tp_size", 1) > 1 else ""
    engine = "fsdp2" if s.get("zero_engine") == "fsdp2" else s["mode"]  # MODES' key of an FSDP2 run
    mode = engine + tp + ("-sp" if tp and s["sequence_parallel"] else "")
    if s.get("compile") == "deepcompile":
        mode += "-deepcompile"
    return table_row(RunResult(mode, s.get("fused_kernels", "none"), s["batch_size_per_gpu"], "included",
                               run_dir.name, "ok", summary=s))


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def format_row(row: dict[str, Any]) -> str:
    return (f"{_fmt(row['tokens_per_s'], ',.0f')} tok/s, MFU {_pct(row['mfu'])}, "
            f"peak {_fmt(row['peak_allocated_gib'], '.1f')} GiB")


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    profiled = any(r.get("device_busy_pct") is not None for r in rows)
    shown = [{
        "configuration": r["configuration"], "kernels": r["fused_kernels"],
        "batch/GPU": f"{r['batch_per_gpu']}" + (" (max)" if r["batch_choice"] == "max" else ""),
        "tokens/s": _fmt(r["tokens_per_s"], ",.0f"),
        "MFU": _pct(r["mfu"]),
        "peak mem alloc / reserved (GiB)": f"{_fmt(r['peak_allocated_gib'], '.1f')} / "
                                           f"{_fmt(r['peak_reserved_gib'], '.1f')}",
        "step (s)": _fmt(r["step_time_s"], ".3f"),
        **({"device busy": _fmt(r["device_busy_pct"], ".1f") + ("%" if r["device_busy_pct"] is not None else ""),
            "kernels/step": _fmt(r["kernels_per_step"], ",.0f")} if profiled else {}),
        "run time (s)": _fmt(r["run_time_s"], ".0f"),
        "status": r["status"] + (f": {r['error']}" if r["status"] != "ok" else ""),
        "parity": r["parity"],
    } for r in rows]
    devices = sorted({r["device"] for r in rows if r["device"]})
    hosts = sorted({r["host_cpu"] for r in rows if r.get("host_cpu")})
    if args.parity:
        gate = (f"parity: the verdict of each run's configuration in {', '.join(map(str, args.parity))} "
                "(tools.parity); a run without `pass` trains an unchecked or a different function: its "
                "throughput is not for publication, and report.md leaves it out (`n/a`: not a train.py run).")
    else:
        gate = "parity: unchecked (no --parity): these throughput numbers carry no parity verdict; do not publish them."
    header = (f"# Training sweep: {args.model}, seq {args.seq_len}, {args.precision}, {args.data} data, "
              f"{args.gpus} processes, {args.steps} steps ({args.warmup} warm-up)\n\n"
              f"device: {', '.join(devices) or 'n/a'}; host: {'; '.join(hosts) or 'n/a'}; "
              f"peak memory is the max over ranks; "
              f"tokens/s and MFU average the post-warm-up steps"
              f"{' (under --profile, only those after the profiled ones)' if profiled else ''}.\n\n"
              + ("device busy: the union of kernel intervals over the profiled steps' wall time (1 - busy: the share "
                 "the device waited for the host).\n\n" if profiled else "") + f"{gate}\n\n")
    return header + markdown_table(shown, list(shown[0])) + "\n"


def write_outputs(sweep: Sweep) -> list[dict[str, Any]]:
    """sweep.csv (every launch, OOM probes included) and sweep.md (one row per point, included runs first, with
    each failure's status and each run's parity verdict), then tools.report's report.md and plots over the runs
    that finished (with --parity: and pass, or are not train.py runs)."""
    verdicts = read_verdicts(sweep.args.parity) if sweep.args.parity else None

    def parity(run_dir: Path) -> str:
        return "unchecked" if verdicts is None else verdict_of(run_dir, verdicts)

    included = [{**row, "parity": parity(Path(p))} for p in sweep.args.include if (row := included_row(Path(p)))]
    launched = [{**table_row(r), "parity": parity(sweep.out / "runs" / r.name)} for r in sweep.results]
    write_csv(sweep.out / "sweep.csv", included + launched)
    probes = {(r.mode, r.fused, r.batch) for r in sweep.results if r.batch_choice == "max" and r.status == "oom"}
    shown = included + [row for row, r in zip(launched, sweep.results)
                        if not (r.batch_choice == "max" and (r.mode, r.fused, r.batch) in probes)]
    if shown:
        (sweep.out / "sweep.md").write_text(markdown(shown, sweep.args) + "".join(
            f"\nout of memory in the max-batch search: {MODES[m].label}, {f}, batch {b}" for m, f, b in sorted(probes)))
    folders = [Path(p) for p in sweep.args.include] + [sweep.out / "runs" / r.name for r in sweep.results
                                                       if r.status == "ok"]
    if verdicts is not None:  # no speed without parity
        folders = [f for f in folders if parity(f) in ("pass", "n/a")]
    runs = [run for run in map(report.load_run, dict.fromkeys(folders)) if run is not None]
    if runs:
        (sweep.out / "report.md").write_text(report.markdown(runs))
        report.plot(runs, sweep.out)
    return shown


# --extra-args flags the store's own columns hold (`compile`) or that it names in words (a profiled run's steps after
# the profiled ones are timed; earlier rows say "profiled")
STORE_COLUMN_FLAGS = frozenset({"--compile"})
STORE_VARIANT_WORDS = {"--profile": "profiled"}


def store_variant(extra_args: str) -> str:
    """The store's `variant` of a run launched with `extra_args`: the flags no column of the row holds."""
    words = [STORE_VARIANT_WORDS.get(flag, flag) for flag in shlex.split(extra_args) if flag not in STORE_COLUMN_FLAGS]
    return " ".join(words)


def store_rows(sweep: Sweep) -> list[int]:
    """Append every finished run to the results store, with its configuration's verdict and parity file."""
    args = sweep.args
    verdicts = read_verdicts(args.parity) if args.parity else None
    rows = []
    for r in sweep.results:
        if r.status != "ok" or r.batch_choice == "max" and any(x is not r and x.name == r.name for x in sweep.results):
            continue
        run_dir = sweep.out / "runs" / r.name
        verdict = verdict_of(run_dir, verdicts) if verdicts is not None else "none"
        reference = r.mode.startswith("hf")
        summary = {**r.summary, "engine": "hf"} if reference else r.summary
        config_path = run_dir / "config.json"
        if config_path.is_file():  # the ZeRO stage is in the resolved configuration, not the summary
            parallel = json.loads(config_path.read_text()).get("parallel", {})
            summary = {**summary, "zero_stage": parallel.get("zero_stage")}
        rows.append(results_store.row_from_summary(
            summary, call=args.call, raw=sweep.out / "sweep.csv",
            parity=verdict, parity_file=args.parity[0] if args.parity and verdict == "pass" else None,
            kind="reference" if reference else "throughput", variant=store_variant(args.extra_args)))
    return results_store.append_rows(rows, args.store)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_launches_on_signal()
    sweep = Sweep(args)
    if args.dry_run:
        for mode, fused, batch_spec in sweep.points():
            if batch_spec == "max":
                print(f"# largest of {sorted(args.max_batches, reverse=True)} that fits, tried in that order:")
            for batch in (sorted(args.max_batches, reverse=True) if batch_spec == "max" else [int(batch_spec)]):
                print(shlex.join(command(args, mode, fused, batch, run_name(mode, fused, batch))))
        return 0
    (sweep.out / "logs").mkdir(parents=True, exist_ok=True)
    for mode, fused, batch_spec in sweep.points():
        sweep.run_point(mode, fused, batch_spec)
        write_outputs(sweep)
    shown = write_outputs(sweep)
    if args.store:
        store_rows(sweep)
    if shown:
        print((sweep.out / "sweep.md").read_text())
    print(f"wrote {sweep.out}/sweep.csv, sweep.md, report.md and {', '.join(report.PLOTS)}")
    return 0 if all(r.status == "ok" for r in sweep.results if r.batch_choice == "fixed") else 1


if __name__ == "__main__":
    sys.exit(main())
