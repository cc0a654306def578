"""The configurations `tools.parity` checks: named rows of train.py flags, each launched like a user would.

Every row trains the reference's function: the same global batch of B sequences per optimizer step (per-rank
micro-batch = B / (dp x grad-accum)) and the same validation sequences (--eval-batches scaled by grad-accum), so
only the code path differs. Rows whose backend cannot run here are skipped with train.py's own reason.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import sys
from dataclasses import dataclass

import torch

from gpt2.config.cli import build_parser, parse_args
from gpt2.config.layout import RunLayout, check_deepcompile_runs_here
from gpt2.config.schema import ConfigError, RunConfig
from gpt2.engines.build import check_backends
from parallel.dims import dp_size_of, tp_divides_world
from tools.common import ROOT, torchrun
from tools.parity_verdict import config_key


@dataclass(frozen=True)
class Row:
    name: str
    flags: tuple[str, ...] = ()  # train.py flags on top of the common ones
    nproc: int | None = None  # None: `python train.py`; N: torchrun with N processes (DDP/ZeRO need a launcher)


REFERENCE = Row("single")  # eager: the function every other row must train
NOISE = Row("noise", ("--grad-accum", "2"))  # the same function and data, another float summation order
DDP = ("--mode", "baseline")
TP2 = ("--tp-size", "2")
SP, COMPILE = "--sequence-parallel", "--compile"
DEEPCOMPILE = ("--compile", "--compiler", "deepcompile")  # ZeRO-3 under DeepSpeed's DeepCompile (CUDA only)
# DeepSpeed ZeRO-3's other gathers beside its default (flat tensors, gpt2.runtime.flat_blocks, in units of 4 blocks,
# gpt2.runtime.block_units): each block's own parameters one block a leaf (the default before flat units), flat
# tensors one block a leaf, and flat units of 12 blocks
PER_BLOCK = ("--zero3-fetch", "block", "--zero3-unit-blocks", "1")
FLAT_U1 = ("--zero3-fetch", "flat", "--zero3-unit-blocks", "1")
# flat units of 12 blocks: a third of the hooks and graph calls of the default's, for the host-bound TP layouts
FLAT_U12 = ("--zero3-fetch", "flat", "--zero3-unit-blocks", "12")
FSDP2 = ("--mode", "hybrid", "--zero-engine", "fsdp2")  # ZeRO-3 by PyTorch FSDP2 (gpt2.engines.fsdp2_engine)
# FSDP2 over each parameter on its own, beside its default of each unit's flat tensors (gpt2.runtime.flat_blocks)
FSDP2_TENSORS = ("--fsdp2-params", "tensors")


def _zero(stage: int) -> tuple[str, ...]:
    return ("--mode", "hybrid", "--zero-stage", str(stage))


def one_device_rows() -> list[Row]:
    """Every configuration on one device; DDP and ZeRO at world size 1 under torchrun."""
    rows = [REFERENCE, NOISE,
            Row("compile-model", ("--compile", "--compile-scope", "model")),
            Row("compile-blocks", ("--compile", "--compile-scope", "blocks")),
            Row("fp32", ("--precision", "fp32"))]
    for backend in ("triton", "cuda"):
        rows += [Row(backend, ("--fused-kernels", backend)),
                 Row(f"{backend}-compile", ("--fused-kernels", backend, "--compile"))]
    # the cuda set in per-block graphs: on Hopper the only one-device configuration that runs its whole-MLP op
    rows.append(Row("cuda-compile-blocks", ("--fused-kernels", "cuda", "--compile", "--compile-scope", "blocks")))
    rows.append(Row("triton-adamw-compile", ("--optimizer", "triton", "--compile")))
    rows += [Row("attn-flash", ("--attn", "flash")), Row("attn-auto", ("--attn", "auto")),
             *(Row(f"attn-{k}", ("--attn", f"sdpa-{k}")) for k in ("cudnn", "efficient")),  # flash: sdpa's pick
             Row("act-ckpt", ("--activation-checkpointing",)),
             Row("grad-accum", ("--grad-accum", "4"))]
    for name, flags in [("ddp", DDP)] + [(f"zero{s}", _zero(s)) for s in (1, 2, 3)] + [("fsdp2", FSDP2)]:
        rows += [Row(name, flags, nproc=1), Row(f"{name}-compile", (*flags, "--compile"), nproc=1)]
    rows += [Row("zero3-block-compile", (*_zero(3), *PER_BLOCK, COMPILE), nproc=1),
             Row("zero3-flat-u1-compile", (*_zero(3), *FLAT_U1, COMPILE), nproc=1),
             Row("zero3-flat-u12-compile", (*_zero(3), *FLAT_U12, COMPILE), nproc=1),
             Row("fsdp2-tensors-compile", (*FSDP2, *FSDP2_TENSORS, COMPILE), nproc=1)]
    return rows + [Row("zero3-deepcompile", (*_zero(3), *DEEPCOMPILE), nproc=1)]


def multi_device_rows(world: int) -> list[Row]:
    """DDP and ZeRO at `world` processes, DDP and ZeRO-3 also compiled (the configurations the 4-GPU speed table
    times); tensor parallelism under DDP and ZeRO-3: TP 2 +- sequence parallel, each eager and compiled, and TP 4
    where 4 divides the world; FSDP2 (--zero-engine fsdp2) and FSDP2 + TP 2 +- sequence parallel, each eager,
    compiled and compiled over their own tensors (--fsdp2-params tensors); and each compiled mode of the speed table
    with `--fused-kernels cuda`."""
    w = f"-w{world}"
    rows = [Row("ddp" + w, DDP, world)] + [Row(f"zero{s}{w}", _zero(s), world) for s in (1, 2, 3)]
    rows += [Row(f"ddp-compile{w}", (*DDP, COMPILE), world), Row(f"zero3-compile{w}", (*_zero(3), COMPILE), world)]
    for name, flags in (("ddp-tp2", (*DDP, *TP2)), ("zero3-tp2", (*_zero(3), *TP2))):
        for variant, extra in (("", ()), ("-sp", (SP,)), ("-compile", (COMPILE,)), ("-sp-compile", (SP, COMPILE))):
            rows.append(Row(f"{name}{variant}{w}", (*flags, *extra), world))
    # FSDP2 beside DeepSpeed ZeRO-3: the same rows, eager and compiled, without and with TP 2 (+- sequence parallel)
    for name, flags in (("fsdp2", FSDP2), ("fsdp2-tp2", (*FSDP2, *TP2)), ("fsdp2-tp2-sp", (*FSDP2, *TP2, SP))):
        rows += [Row(f"{name}{w}", flags, world), Row(f"{name}-compile{w}", (*flags, COMPILE), world),
                 Row(f"{name}-tensors-compile{w}", (*flags, *FSDP2_TENSORS, COMPILE), world)]
    # the fused CUDA kernels in each compiled mode of the 4-GPU speed table (its `--fused cuda` rows)
    for name, flags in (("ddp", DDP), ("zero3", _zero(3)), ("zero3-tp2", (*_zero(3), *TP2)), ("fsdp2", FSDP2),
                        ("fsdp2-tp2", (*FSDP2, *TP2))):
        rows.append(Row(f"{name}-cuda-compile{w}", (*flags, "--fused-kernels", "cuda", COMPILE), world))
    # ZeRO-3's other gathers (one block a leaf, its own parameters or flat tensors; flat units of 12), without and
    # with TP 2
    for name, flags in (("zero3", _zero(3)), ("zero3-tp2", (*_zero(3), *TP2))):
        rows += [Row(f"{name}-block-compile{w}", (*flags, *PER_BLOCK, COMPILE), world),
                 Row(f"{name}-flat-u1-compile{w}", (*flags, *FLAT_U1, COMPILE), world),
                 Row(f"{name}-flat-u12-compile{w}", (*flags, *FLAT_U12, COMPILE), world)]
    if world % 4 == 0:
        rows += [Row(f"ddp-tp4{w}", (*DDP, "--tp-size", "4"), world),
                 Row(f"zero3-tp4{w}", (*_zero(3), "--tp-size", "4"), world)]
    return rows + [Row(f"zero3-deepcompile{w}", (*_zero(3), *DEEPCOMPILE), world)]


def matrix(world: int) -> list[Row]:
    return one_device_rows() + (multi_device_rows(world) if world > 1 else [])


def extra_row(spec: str) -> Row:
    """`NAME=FLAGS` (--extra-row): a row of your own, e.g. `lr-x2=--lr 1.2e-3`. --mode single runs under plain
    python, other modes under torchrun with one process per TP rank (dp 1), or, where NAME ends in `-wN` as the
    matrix's rows of world size N do, N processes (e.g. `ddp-cpp-compile-w4=--mode baseline --compile
    --compile-wrapper cpp`)."""
    name, sep, flags = spec.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--extra-row {spec!r}: expected NAME=FLAGS, e.g. lr-x2='--lr 1.2e-3'")
    args = build_parser().parse_args(shlex.split(flags))  # a bad flag stops here, with train.py's message
    world = re.search(r"-w(\d+)$", name)
    if args.mode == "single":
        if world:
            raise ValueError(f"--extra-row {name}: --mode single runs one process; drop -w{world[1]} from its name")
        return Row(name, tuple(shlex.split(flags)), None)
    return Row(name, tuple(shlex.split(flags)), int(world[1]) if world else args.tp_size)  # plan() checks tp | N


def select(rows: list[Row], patterns: list[str] | None) -> list[Row]:
    """The rows matching any name or glob in `patterns` (all rows for None); the reference and noise rows always,
    since every verdict is measured against them."""
    if patterns is None:
        return rows
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(r.name, p) for r in rows)]
    if unknown:
        raise ValueError(f"--rows {' '.join(unknown)} matches no row; rows: {' '.join(r.name for r in rows)}")
    return [r for r in rows if r in (REFERENCE, NOISE) or any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


@dataclass(frozen=True)
class Job:
    """One row for one model: its train.py flags (or why it cannot run here) and its configuration key."""

    row: Row
    model: str
    argv: tuple[str, ...] = ()
    key: str = ""
    skip: str = ""

    def command(self, run_name: str) -> list[str]:
        train = str(ROOT / "train.py")
        launcher = [sys.executable, train] if self.row.nproc is None else [*torchrun(self.row.nproc), train]
        return [*launcher, *self.argv, "--run-name", run_name]


def resolved_key(cfg: RunConfig, world: int, device: str) -> str:
    """The row's config_key with what the run will resolve on `device`: FSDP2's gather dtype and the compiled
    graphs' wrapper (RunLayout.fsdp2_gather, .compile_wrapper); neither where the layout itself is refused (the row
    is skipped below for that)."""
    try:
        layout = RunLayout.resolve(cfg, world, torch.device(device).type)
    except ConfigError:
        return config_key(cfg.to_dict(), world)
    return config_key(cfg.to_dict(), world, layout.fsdp2_gather, layout.compile_wrapper)


def plan(row: Row, model: str, common: list[str], batch: int, eval_batches: int, device: str,
         micro_batch: int | None = None) -> Job:
    """The row's flags for `model` with the global batch `batch` split over dp x grad-accum, or a skip reason.

    With `micro_batch`, the reference's per-rank micro-batch is at most that: every row accumulates
    batch / (dp x micro_batch) micro-steps, times its own --grad-accum (the noise row: half the reference's
    micro-batch). train.py's own parser resolves the flags (tp size, accumulation, kernels, precision) and its
    start-up check decides whether the kernel and attention backends can run here."""
    try:
        cfg = parse_args([*common, *row.flags])
    except ConfigError as err:
        return Job(row, model, skip=str(err))
    world, tp, accum = row.nproc or 1, cfg.parallel.tp_size, cfg.train.grad_accum
    key = resolved_key(cfg, world, device)
    try:
        check_backends(cfg)
        if cfg.train.compile and cfg.train.compiler == "deepcompile":
            check_deepcompile_runs_here(torch.device(device).type)
    except ConfigError as err:
        return Job(row, model, key=key, skip=str(err))
    if not tp_divides_world(world, tp):
        return Job(row, model, key=key, skip=f"--tp-size {tp} does not divide the {world} processes")
    dp = dp_size_of(world, tp)
    if micro_batch is not None:
        if batch % (dp * micro_batch):
            return Job(row, model, key=key, skip=f"batch {batch} is not divisible by dp {dp} x micro-batch "
                                                 f"{micro_batch}")
        accum *= batch // (dp * micro_batch)
    if batch % (dp * accum):
        return Job(row, model, key=key, skip=f"batch {batch} is not divisible by dp {dp} x grad-accum {accum}")
    if device == "cpu" and cfg.train.precision == "fp32":
        return Job(row, model, key=key, skip="CPU runs are fp32 whatever --precision says: this would repeat the "
                                             "reference")
    argv = (*common, *row.flags, "--grad-accum", str(accum), "--batch-size", str(batch // (dp * accum)),
            "--eval-batches", str(eval_batches * accum))
    return Job(row, model, argv, key)
