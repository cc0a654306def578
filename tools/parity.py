"""Loss parity: does every configuration train the same function as `--mode single` eager, on real text, in the
precision the runs use (bf16 on a GPU, fp32 on CPU)?

    python -m tools.parity --out benchmarks/results/parity/h100 --models gpt2 gpt2-large --jobs 2
    python -m tools.parity --out /tmp/p --models gpt2 --rows 'zero*' ddp --steps 10   # a subset (names, globs)
    python -m tools.parity --out /tmp/p --models gpt2 --extra-row lr-x2='--lr 1.2e-3'  # a row of your own
    python -m tools.parity --out /tmp/p --dry-run                                      # the commands only

Each row of tools/parity_matrix.py (one-device rows; with more GPUs visible, DDP/ZeRO at that world size and
tensor parallelism) trains --steps steps from the same seed on the same global batches of --batch-size sequences,
its loss logged every step, then its validation loss. Data: WikiText-2 from ../shared/data by default, or
--data-path any text (--cache-dir a pre-built token cache); the training set is cut to whole global batches so that
every row's epochs line up. The reference (`single`) and the `noise` row run in the same call, up to --jobs rows at
a time on each GPU (one-GPU rows spread over the visible GPUs, a row of N processes takes N of them, each run's
CUDA_VISIBLE_DEVICES naming its GPUs); the verdicts are tools/parity_verdict.py's. Written to --out, and rewritten
each time a run ends (rows still running read `pending`, the header says how many ended), and once more when the
tool is stopped (SIGTERM, SIGINT: then a run that wrote its summary but was still exiting is judged from it), so a
call killed part-way keeps the finished rows' verdicts: parity.csv, parity.md (command, device, versions, the
tolerance rule with the measured noise, one table per model) and parity_<model>.png; run folders in OUT/runs, each
launch's output in OUT/logs.
Exit status 1 if a row fails or errors, 2 on bad flags or data.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple

import torch

from gpt2.config.cli import parse_args as parse_train_args
from gpt2.config.schema import MODEL_PRESETS, ConfigError, DataConfig, positive_int
from gpt2.runtime.distributed import LAUNCHER_VARS
from tools import parity_report, results_store
from tools.common import ROOT, device_tag, error_excerpt, free_run_name, last_error, launch, stop_launches_on_signal
from tools.parity_matrix import NOISE, REFERENCE, Job, extra_row, matrix, plan, select
from tools.parity_report import RowResult, Tolerance
from tools.parity_verdict import (
    Curve,
    CurveError,
    compare,
    default_floor,
    load_curve,
    max_abs_dloss,
    tolerance,
)

SHARED_DATA = ROOT.parent / "shared" / "data"
DEFAULT_DATA = SHARED_DATA / "wikitext-2"
DEFAULT_TOKENIZER = SHARED_DATA / "gpt2-tokenizer" / "tokenizer.json"
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class Protocol:
    """The training settings a model's parity is judged at; each flag of the same name overrides its field."""
    batch_size: int  # global: sequences per optimizer step
    micro_batch: int | None  # largest per-rank micro-batch (None: the reference takes the global batch at once)
    steps: int
    warmup_steps: int
    lr: float

    def __str__(self) -> str:
        micro = f", micro-batch at most {self.micro_batch}" if self.micro_batch else ""
        return (f"global batch {self.batch_size} (micro-batch x grad-accum x dp{micro}), {self.steps} steps, "
                f"lr {self.lr:.1e} (warm-up {self.warmup_steps})")


SMALL_PROTOCOL = Protocol(batch_size=8, micro_batch=None, steps=30, warmup_steps=10, lr=6e-4)
# gpt2-large at lr 6e-4 spikes early in every row, and DeepSpeed ZeRO-3 rows then leave the band: a false fail. At
# 2.5e-4 (GPT-3's lr for its 760M model) every row passed (docs/decisions.md); micro-batch 2 lets 4-6 rows share a
# GPU and leaves dp x accumulation to split 32 at TP 2 and 4 GPUs. gpt2-medium and -xl take it too, untried: the
# nearest tried model of their size class.
LARGE_PROTOCOL = Protocol(batch_size=32, micro_batch=2, steps=10, warmup_steps=5, lr=2.5e-4)
PROTOCOLS = {"gpt2-tiny": SMALL_PROTOCOL, "gpt2": SMALL_PROTOCOL, "gpt2-medium": LARGE_PROTOCOL,
             "gpt2-large": LARGE_PROTOCOL, "gpt2-xl": LARGE_PROTOCOL}


def protocol_of(model: str, args: argparse.Namespace) -> Protocol:
    """The model's protocol with the flags given on the command line in place of its fields."""
    given = {f.name: getattr(args, f.name) for f in fields(Protocol) if getattr(args, f.name) is not None}
    return replace(PROTOCOLS[model], **given)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m tools.parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for parity.csv/.md/.png, runs/ and logs/")
    results_store.add_store_arguments(p)
    p.add_argument("--models", nargs="+", default=["gpt2", "gpt2-large"], choices=sorted(MODEL_PRESETS))
    p.add_argument("--rows", nargs="+", metavar="NAME", help="row names or globs (default: all); single and noise "
                   "always run")
    p.add_argument("--extra-row", action="append", default=[], metavar="NAME=FLAGS",
                   help="another row (repeatable; always run): train.py flags on top of the common ones, e.g. "
                        "lr-x2='--lr 1.2e-3'; a NAME ending in -wN runs N processes (else one per TP rank)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, help="global batch: sequences per optimizer step. This and the next "
                   f"four default by model: gpt2-tiny and gpt2 {SMALL_PROTOCOL}; gpt2-medium, -large and -xl "
                   f"{LARGE_PROTOCOL}")
    p.add_argument("--micro-batch", type=int, help="largest per-rank micro-batch: every row accumulates gradients "
                   "to reach --batch-size (none: the reference takes the global batch at once)")
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup-steps", type=int, help="LR warm-up")
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-batches", type=positive_int, default=8, help="validation batches of --batch-size sequences")
    p.add_argument("--data", choices=["wikitext", "synthetic"], default="wikitext",
                   help="synthetic: random tokens (smoke tests; no text)")
    p.add_argument("--data-path", help=f"text file or folder (default {DEFAULT_DATA}, where it exists)")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer.json, folder or hub name")
    p.add_argument("--cache-dir", help=f"token cache (default: train.py's, {ROOT / DataConfig.cache_dir})")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--jobs", type=int, default=1, help="rows run at once on each device: one-GPU rows spread over the "
                   "visible GPUs (CUDA_VISIBLE_DEVICES), a row of N processes takes a slot on N of them")
    p.add_argument("--tol-factor", type=float, default=3.0, help="tolerance = max(floor, factor x noise)")
    p.add_argument("--tol-floor", type=float,
                   help="default by the reference's precision: 0.05 for bf16, 1e-4 for fp32")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run before it is killed")
    p.add_argument("--dry-run", action="store_true", help="print each row's command (or why it is skipped)")
    return p, p.parse_args(argv)


def data_flags(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    """train.py's data flags, paths made absolute (the runs start in the repository root)."""
    if args.data == "synthetic":
        if args.data_path:
            p.error("--data synthetic ignores --data-path; drop one of the two")
        return ["--data", "synthetic"]
    path = Path(args.data_path) if args.data_path else DEFAULT_DATA
    if not path.exists():
        p.error(f"--data-path {path} does not exist: pass --data-path (a text file, or a folder of train/valid "
                "text files), or --data synthetic")
    tokenizer = Path(args.tokenizer).resolve() if Path(args.tokenizer).exists() else args.tokenizer  # or a hub name
    cache = Path(args.cache_dir).resolve() if args.cache_dir else ROOT / DataConfig.cache_dir
    return ["--data-path", str(path.resolve()), "--tokenizer", str(tokenizer), "--cache-dir", str(cache)]


class DataCut(NamedTuple):
    max_samples: int  # train.py's --max-samples: the training blocks of whole global batches
    eval_batches: int  # train.py's --eval-batches: at most the validation batches there are


def prepare_data(common: list[str], batch: int, eval_batches: int) -> DataCut:
    """Build the token cache once, here (the runs then hit it), and return the cut of the data for `batch`.

    --max-samples: the training blocks of whole global batches. The loader's epoch is floor(blocks / its batch)
    micro-batches, so with a remainder a run with micro-batch B/4 and 4 accumulation steps would roll over at a
    different step than the reference. --eval-batches: at most the validation batches there are."""
    from gpt2.data.loader import build_data

    cfg = parse_train_args([*common, "--batch-size", str(batch)])
    bundle = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=batch, model_vocab_size=cfg.model.vocab_size,
                        dp_rank=0, dp_size=1, seed=cfg.train.seed, is_main=True, barrier=lambda: None)
    return DataCut(len(bundle.train) * batch, min(eval_batches, len(bundle.val)))


@dataclass(frozen=True)
class Outcome:
    command: str
    rc: int | None  # None: killed at --run-timeout
    wall_s: float
    run_dir: Path
    log: Path
    exited: bool = True  # False: the tool was stopped after the run wrote its summary, while its processes exited

    def curve(self) -> Curve:
        if self.rc is None:
            raise CurveError(f"killed after {self.wall_s:.0f} s (--run-timeout)")
        if self.rc != 0:
            raise CurveError(f"exit {self.rc}: {last_error(self.log.read_text(errors='replace'))}")
        return load_curve(self.run_dir)

    def log_tail(self) -> list[str]:
        return error_excerpt(self.log.read_text(errors="replace"), LOG_TAIL_LINES)


class DeviceSlots:
    """Which devices a run may use: `per_device` runs at once on each; a run of N processes takes a slot on each of
    the N least busy devices (its CUDA_VISIBLE_DEVICES), so one-GPU rows run side by side, one a GPU, and a
    4-process row waits for a slot on all four. First come, first served: a run waits for those that asked before
    it, so rows start in the matrix's order and a wide row is not passed over by narrow ones. On the CPU, one
    device with `per_device` slots."""

    def __init__(self, names: list[str], per_device: int):
        self.names, self.free = names, [per_device] * len(names)
        self.changed = threading.Condition()
        self.queue: deque[object] = deque()

    @contextmanager
    def take(self, n: int) -> Iterator[list[str]]:
        if n > len(self.names):
            raise ValueError(f"needs {n} devices, {len(self.names)} visible")
        me = object()
        with self.changed:
            self.queue.append(me)
            self.changed.wait_for(lambda: self.queue[0] is me and sum(f > 0 for f in self.free) >= n)
            self.queue.popleft()
            taken = sorted(range(len(self.free)), key=lambda d: -self.free[d])[:n]  # the least busy
            for d in taken:
                self.free[d] -= 1
            self.changed.notify_all()  # the next in line may fit too
        try:
            yield [self.names[d] for d in taken]
        finally:
            with self.changed:
                for d in taken:
                    self.free[d] += 1
                self.changed.notify_all()


def visible_gpus() -> list[str]:
    """The GPUs this process sees, named as a child's CUDA_VISIBLE_DEVICES must name them."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = inherited.split(",") if inherited else [str(i) for i in range(torch.cuda.device_count())]
    return names[:torch.cuda.device_count()]


def run_paths(out: Path, name: str) -> tuple[Path, Path]:
    """A run's folder and its launch's output file under --out."""
    return out / "runs" / name, out / "logs" / f"{name}.log"


def name_runs(jobs: list[Job], out: Path) -> dict[Job, str]:
    """Each job's run name: distinct within this call, and free of earlier calls' runs in the same --out."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    names = {}
    for job in jobs:
        names[job] = free_run_name(out, f"{job.row.name}-{job.model}")
        run_paths(out, names[job])[1].touch()  # taken: the next job's free name is another
    return names


def finished(jobs: list[Job], names: dict[Job, str], out: Path, outcomes: dict[Job, Outcome]) -> dict[Job, Outcome]:
    """The outcomes, and the runs not among them that wrote their summary (stopped while exiting: work done)."""
    done = dict(outcomes)
    for job in jobs:
        run_dir, log = run_paths(out, names[job])
        if job not in done and (run_dir / "summary.json").is_file():
            done[job] = Outcome(shlex.join(job.command(names[job])), 0, 0.0, run_dir, log, exited=False)
    return done


def run_all(jobs: list[Job], names: dict[Job, str], out: Path, slots: DeviceSlots, timeout: float, gpus: bool,
            outcomes: dict[Job, Outcome] | None = None,
            on_done: Callable[[dict[Job, Outcome]], None] = lambda outcomes: None) -> dict[Job, Outcome]:
    """Launch every runnable job as `slots` allow (with `gpus`, each on the GPUs it took; torchrun rows bind ports of
    their own) under its name in `names`, filling `outcomes` (the caller's: read it if the call is stopped);
    `on_done(outcomes so far)` after each one ends."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on shared machines

    def run(job: Job) -> Outcome:
        cmd = job.command(names[job])
        run_dir, log = run_paths(out, names[job])
        with slots.take((job.row.nproc or 1) if gpus else 1) as devices:  # CPU ranks share the one device
            rc, wall = launch(cmd, log, timeout, {**env, "CUDA_VISIBLE_DEVICES": ",".join(devices)} if gpus else env)
        return Outcome(shlex.join(cmd), rc, wall, run_dir, log)

    outcomes = {} if outcomes is None else outcomes
    with ThreadPoolExecutor(max_workers=sum(slots.free)) as pool:
        futures = {pool.submit(run, job): job for job in jobs}
        for future in as_completed(futures):
            job, outcome = futures[future], future.result()
            outcomes[job] = outcome
            status = "ok" if outcome.rc == 0 else f"exit {outcome.rc}" if outcome.rc is not None else "timeout"
            print(f"[{len(outcomes)}/{len(jobs)}] {job.model} {job.row.name}: {status} in {outcome.wall_s:.0f} s",
                  flush=True)
            try:
                on_done(outcomes)
            except Exception as err:  # a table that cannot be written now must not cost the runs still going
                print(f"could not write the partial tables: {err}", flush=True)
    return outcomes


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # the ZeRO rows are then errors naming the missing module
        return "not installed"


def judge(jobs: list[Job], outcomes: dict[Job, Outcome], args: argparse.Namespace
          ) -> tuple[list[RowResult], Tolerance | None]:
    """One model's rows against its reference, and the tolerance (None without a reference curve)."""
    curves: dict[Job, Curve] = {}
    errors: dict[Job, str] = {}
    for job in jobs:
        try:
            if job in outcomes:
                curves[job] = outcomes[job].curve()
        except CurveError as err:
            errors[job] = str(err)
    # rows are judged once the reference and the noise row (the tolerance) have ended, never against a guess
    waiting = any(j.row in (REFERENCE, NOISE) and not j.skip and j not in outcomes for j in jobs)
    ref = next((curves.get(j) for j in jobs if j.row == REFERENCE), None)
    noise_curve = next((curves.get(j) for j in jobs if j.row == NOISE), None)
    tol = None
    if ref is not None:
        try:
            noise = max_abs_dloss(ref, noise_curve) if noise_curve is not None else None
        except CurveError:  # other steps logged: the noise row itself is an error below
            noise = None
        floor = args.tol_floor if args.tol_floor is not None else default_floor(ref.precision)
        tol = Tolerance(noise, args.tol_factor, floor, tolerance(noise, args.tol_factor, floor), ref.precision)
    results = []
    for job in jobs:
        r = RowResult(job.row.name, job.model, "skipped", "python" if job.row.nproc is None else
                      f"torchrun x{job.row.nproc}", job.row.flags, note=job.skip, key=job.key)
        results.append(r)
        if job.skip:
            continue
        if job not in outcomes or waiting:
            r.verdict, r.note = "pending", ("still running when this table was written" if job not in outcomes
                                            else "ended; judged once single and noise have ended")
            continue
        outcome = outcomes[job]
        r.command, r.run_dir, r.curve = outcome.command, str(outcome.run_dir), curves.get(job)
        if job in errors:
            r.verdict, r.note, r.log_tail = "error", errors[job], outcome.log_tail()
            continue
        if ref is None or tol is None:
            r.verdict, r.note = "error", "no reference curve: the single run failed"
            continue
        try:
            r.comparison = compare(ref, r.curve, tol.value)
        except CurveError as err:
            r.verdict, r.note = "error", str(err)
            continue
        if job.row == REFERENCE:
            r.verdict = "reference"
        elif job.row == NOISE:
            r.verdict, r.note = "noise", "sets the tolerance"
        elif r.curve.precision != ref.precision:
            r.verdict = "precision"
            r.note = (f"{r.curve.precision} against the {ref.precision} reference: not judged, the difference "
                      "measures precision, not the code path")
        else:
            r.verdict = "pass" if r.comparison.passed else "fail"
        if not outcome.exited:
            r.note = "judged from its summary: the call was stopped while the run exited"
    return results, tol


def store_verdicts(results: list[parity_report.RowResult], out: Path, args: argparse.Namespace) -> list[int]:
    """One results-store row per judged configuration (kind parity): its key, verdict and parity.csv."""
    rows = []
    for r in results:
        if r.verdict not in ("pass", "fail"):
            continue
        summary_path = Path(r.run_dir) / "summary.json"
        summary = json.loads(summary_path.read_text()) if r.run_dir and summary_path.is_file() else {}
        c = r.comparison
        note = f"max |dloss| {c.max_abs_dloss:.2e}, tolerance {c.tolerance:.2e}" if c else ""
        rows.append({**results_store.row_from_summary(
            summary, call=args.call, raw=out / "parity.csv", parity=r.verdict, parity_file=out / "parity.csv",
            kind="parity", variant=r.config, note=note), "tokens_per_s": None, "mfu": None, "model": r.model})
    return results_store.append_rows(rows, args.store)


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    stop_launches_on_signal()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = torch.cuda.device_count() if device == "cuda" else 1
    try:
        rows = select(matrix(world), args.rows) + [extra_row(spec) for spec in args.extra_row]
    except ValueError as err:
        p.error(str(err))
    if len({r.name for r in rows}) < len(rows):
        p.error("--extra-row names must differ from each other and from the matrix rows")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    protocols = {model: protocol_of(model, args) for model in args.models}
    for model, proto in protocols.items():
        if proto.micro_batch is not None and (proto.micro_batch < 1 or proto.batch_size % proto.micro_batch):
            p.error(f"--micro-batch {proto.micro_batch} must be >= 1 and divide {model}'s global batch "
                    f"{proto.batch_size} (--batch-size)")
    out = args.out.resolve()
    data = data_flags(args, p)

    def common(model: str) -> list[str]:
        proto = protocols[model]
        return ["--model", model, "--seq-len", str(args.seq_len), "--max-steps", str(proto.steps),
                "--log-interval", "1", "--eval-interval", "0", "--warmup-steps", str(proto.warmup_steps),
                "--lr", str(proto.lr), "--seed", str(args.seed), "--wandb", "disabled",
                "--throughput-warmup-steps", "0",  # throughput is not what this measures
                "--device", device, "--out-dir", str(out / "runs"), *data]

    try:
        cuts = {model: prepare_data(common(model), proto.batch_size, args.eval_batches)
                for model, proto in protocols.items()}  # each model's global batch cuts its own data
        jobs = [plan(row, model, [*common(model), "--max-samples", str(cuts[model].max_samples)], proto.batch_size,
                     cuts[model].eval_batches, device, proto.micro_batch)
                for model, proto in protocols.items() for row in rows]
    except ConfigError as err:
        p.error(str(err))
    except ModuleNotFoundError as err:  # tokenising needs `datasets`, which a GPU machine may lack
        p.error(f"building the token cache needs the {err.name} package; build it where {err.name} is installed "
                "(python -m gpt2.data --data-path ... --tokenizer ... --cache-dir DIR) and pass --cache-dir DIR")
    gpus = visible_gpus() if device == "cuda" else []
    jobs = [replace(j, skip=f"needs {j.row.nproc} GPUs, {len(gpus)} visible") if gpus and not j.skip and
            (j.row.nproc or 1) > len(gpus) else j for j in jobs]  # an --extra-row wider than the machine
    runnable = [job for job in jobs if not job.skip]
    if args.dry_run:
        for job in jobs:
            print(f"# {job.model} {job.row.name}: skipped: {job.skip}" if job.skip else
                  shlex.join(job.command(f"{job.row.name}-{job.model}")))
        return 0

    tag = {**device_tag(device), "deepspeed": package_version("deepspeed")}
    header = {
        "command": f"`python -m tools.parity {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        "device": f"{tag['device']} x{tag['device_count']}" if device == "cuda" else tag["device"],
        "host": tag["host_cpu"],
        "versions": f"torch {tag['torch']}, CUDA {tag['cuda']}, triton {tag['triton']}, deepspeed {tag['deepspeed']}",
        "date": tag["date"],
        "settings": "; ".join(f"{model}: seq {args.seq_len}, {proto}, seed {args.seed}, validation loss over "
                              f"{cuts[model].eval_batches} x {proto.batch_size} sequences"
                              for model, proto in protocols.items()),
        "data": f"`{shlex.join(data)}`, the first "
                + ", ".join(f"{cut.max_samples} training sequences ({model})" for model, cut in cuts.items()),
    }
    out.mkdir(parents=True, exist_ok=True)

    def write_tables(outcomes: dict[Job, Outcome]) -> list[RowResult]:
        """Judge what has ended and write parity.csv/md/png: after every run, so a call killed mid-way keeps the
        verdicts of the rows that finished (the others `pending`, the header saying how many ended)."""
        results: list[RowResult] = []
        tolerances: dict[str, Tolerance] = {}
        for model in args.models:
            model_results, tol = judge([j for j in jobs if j.model == model], outcomes, args)
            results += model_results
            if tol is not None:
                tolerances[model] = tol
        ended = ({"status": f"partial: {len(outcomes)} of {len(runnable)} runs ended; rewritten as each run ends"}
                 if len(outcomes) < len(runnable) else {})
        parity_report.write(out, results, tolerances, {**header, **ended}, tag)
        return results

    slots = DeviceSlots(gpus or [device], args.jobs)
    print(f"{len(runnable)} runs ({len(jobs) - len(runnable)} skipped), {args.jobs} at a time on each of "
          f"{len(slots.names)} {'GPUs' if gpus else device}", flush=True)

    def write_partial(ended: dict[Job, Outcome]) -> None:
        if len(ended) < len(runnable):  # the complete tables are written once, below
            write_tables(ended)

    names = name_runs(runnable, out)
    outcomes: dict[Job, Outcome] = {}
    stored = False  # --store writes the verdicts once: at the end, or when stopped before it

    def store_once(results: list[RowResult]) -> None:
        nonlocal stored
        if args.store and not stored:
            stored = True
            store_verdicts(results, out, args)

    def on_stop() -> None:
        """Stopped (the device call's limit, Ctrl-C): the last tables also judge the runs that wrote their summary,
        and --store keeps the verdicts reached."""
        store_once(write_tables(finished(runnable, names, out, outcomes)))

    stop_launches_on_signal(before_exit=on_stop)
    results = write_tables(run_all(runnable, names, out, slots, args.run_timeout, bool(gpus), outcomes,
                                   on_done=write_partial))
    for r in results:
        c = r.comparison
        delta = f"max |dloss| {c.max_abs_dloss:.2e}, dval {c.val_dloss:+.2e}, tol {c.tolerance:.2e}" if c else ""
        print(f"{r.model:12s} {r.config:22s} {r.verdict:9s} {delta} {r.note}")
    print(f"wrote {out}/parity.csv, parity.md and parity_<model>.png")
    store_once(results)
    return 1 if any(r.verdict in ("fail", "error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
