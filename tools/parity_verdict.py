"""Loss-parity verdicts: does a run train the same function as the reference run?

The API `tools.parity` builds its table with, and that `tools.train_sweep` reads back:

    ref, other = load_curve(ref_dir), load_curve(run_dir)     # per-step training loss + validation loss
    tol = tolerance(noise=max_abs_dloss(ref, noise_curve), factor=3, floor=default_floor(ref.precision))
    result = compare(ref, other, tol)                          # max |dloss|, final and validation deltas, pass?
    verdicts = read_verdicts([Path("benchmarks/results/parity/h100/parity.csv")])
    verdict_of(run_dir, verdicts)                              # "pass" | "fail" | ... | "none" (never checked)

A configuration is named by `config_key` (model, layout, world size, kernels, attention, compile scope,
activation checkpointing, precision, and the optimizer where it is not torch's): a throughput run and a parity row
with the same key ran the same code.

Also a CLI for the GPU result scripts, which make run folders outside the sweep:

    python -m tools.parity_verdict RUN_DIR... --parity PARITY.csv...  # a verdict per run; exit 1 unless all pass
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from gpt2.config.layout import zero3_unit_blocks_of
from gpt2.config.schema import Mode, compile_label
from gpt2.observe.run_logging import run_label
from tools.report import load_run

# verdicts, best first: a configuration checked by several rows (e.g. `single` and `grad-accum` share a key) gets
# the worst of them. `reference` and `noise` are the rows the others are measured against: they pass by definition.
# `precision`: a row computing in another precision than the reference (fp32 against bf16) is not judged.
# `pending`: a row not yet judged when a partial parity.csv was written (tools.parity rewrites it per run):
# still running, or waiting for the reference and noise rows.
VERDICTS = ("reference", "noise", "pass", "precision", "skipped", "pending", "fail", "error")
PASSING = frozenset({"reference", "noise", "pass"})
TRAIN_MODES = get_args(Mode)  # train.py's --mode choices
# default floor of the tolerance, by the reference run's precision. The noise row measures a summation-order change
# only; configurations that fuse or round differently but compute the same function wander further in bf16, yet
# far less than the two bugs this gate exists for moved the loss (ZeRO-3 --compile, GPT-2 Large whole-model
# compile). fp32 on CPU runs agree to far below 1e-4, so a difference above it fails. The runs: docs/decisions.md.
FLOOR = {"bf16": 0.05, "fp32": 1e-4}


class CurveError(ValueError):
    """A run folder holds no usable loss curve (the run failed or did not finish)."""


@dataclass(frozen=True)
class Curve:
    steps: tuple[int, ...]
    losses: tuple[float, ...]
    val_loss: float
    precision: str  # what the run computed in (summary "precision": fp32 on CPU whatever --precision says)


@dataclass(frozen=True)
class Comparison:
    max_abs_dloss: float  # max over steps of |loss - reference loss|
    final_dloss: float  # loss - reference loss at the last step
    val_dloss: float  # validation loss - reference validation loss
    tolerance: float
    steps: int

    @property
    def passed(self) -> bool:
        return self.max_abs_dloss <= self.tolerance and abs(self.val_dloss) <= self.tolerance


def load_curve(run_dir: Path) -> Curve:
    """The logged training losses, the final validation loss and the precision of a finished run.

    train.py stops with an error at a non-finite logged loss, so a run with a summary has a finite curve."""
    run = load_run(Path(run_dir))
    if run is None:
        raise CurveError(f"{run_dir} has no summary record: the run did not finish")
    if not run.steps:
        raise CurveError(f"{run_dir} logged no training loss")
    if run.summary.get("val_loss") is None:
        raise CurveError(f"{run_dir} has no validation loss")
    return Curve(tuple(r["step"] for r in run.steps), tuple(r["loss"] for r in run.steps),
                 run.summary["val_loss"], run.summary["precision"])


def max_abs_dloss(ref: Curve, other: Curve) -> float:
    """max over the logged steps of |other - ref|; the steps must be the same."""
    if other.steps != ref.steps:
        raise CurveError(f"logged steps differ from the reference's: {other.steps[:5]}... vs {ref.steps[:5]}...")
    return max(abs(a - b) for a, b in zip(other.losses, ref.losses))


def default_floor(precision: str) -> float:
    return FLOOR[precision]


def tolerance(noise: float | None, factor: float, floor: float) -> float:
    """max(floor, factor x noise): the measured run-to-run noise scaled by a safety factor, never below the floor.
    `noise` is None when it could not be measured; the floor alone applies then."""
    return floor if noise is None else max(floor, factor * noise)


def compare(ref: Curve, other: Curve, tol: float) -> Comparison:
    """`other` against the reference curve: it passes iff max |dloss| <= tol and |dval| <= tol."""
    return Comparison(max_abs_dloss=max_abs_dloss(ref, other), final_dloss=other.losses[-1] - ref.losses[-1],
                      val_dloss=other.val_loss - ref.val_loss, tolerance=tol, steps=len(ref.steps))


def worst(verdicts: list[str]) -> str:
    return max(verdicts, key=VERDICTS.index)


# ----------------------------------------------------------------------------------------------
# configuration keys: a throughput run meets the parity row of its configuration


def config_key(config: dict[str, Any], world_size: int, fsdp2_gather: str | None = None,
               compile_wrapper: str | None = None) -> str:
    """The code path a run takes, from its config.json (= RunConfig.to_dict()) and world size, e.g.
    `gpt2-large zero3-tp2-sp w4 kernels=triton attn=sdpa compile=blocks ckpt=off bf16 fetch=block zprec=autocast`.

    Batch size, accumulation, step counts and learning rate are left out: a parity run checks the code path at its
    own (small) batch, a throughput run measures it at its own. The precision is --precision as given (a CPU run
    computes in fp32 whatever it says). `fsdp2_gather`: FSDP2's gather dtype as the run resolved it (its summary's
    `fsdp2_gather`; `auto` follows rules that may change); without it, --fsdp2-gather as given, and fp32 for configs
    from before that flag. `compile_wrapper`: the host code of the compiled graphs as the run resolved it (its
    summary's `compile_wrapper`, "cpp" or "python"): the same kernels, but C++ calls the graphs' collectives and
    custom ops through other code, so a verdict holds for the wrapper it ran with; without it, none is named."""
    t, p = config["train"], config["parallel"]
    label = run_label(t["mode"], p["zero_stage"], p["tp_size"], p["sequence_parallel"],
                      p.get("zero_engine", "deepspeed"))
    compiled = compile_label(t["compile"], t["compile_scope"], t.get("compiler", "torch"))
    key = (f"{t['model']} {label} w{world_size} kernels={t['fused_kernels']} attn={t['attn']} "
           f"compile={compiled} "
           f"ckpt={'on' if t['activation_checkpointing'] else 'off'} {t['precision']}")
    fsdp2 = p.get("zero_engine") == "fsdp2"  # FSDP2 reads neither setting: its label says the engine
    # DeepCompile removes ZeRO-3's gather hooks: no fetch unit either
    if t["mode"] == "hybrid" and p["zero_stage"] == 3 and not fsdp2 and compiled != "deepcompile":
        key += f" fetch={p['zero3_fetch']}"
        # configs from before --zero3-unit-blocks: one block a leaf; None (left out): the model's default unit
        unit = zero3_unit_blocks_of(p["zero3_fetch"], p.get("zero3_unit_blocks", 1), config["model"]["n_layer"])
        if unit > 1:
            key += f" unit={unit}"
    if t["mode"] == "hybrid" and not fsdp2:  # configs from before --zero-precision ran DeepSpeed's 16-bit model
        key += f" zprec={p.get('zero_precision', 'deepspeed')}"
    if fsdp2:
        key += f" gather={fsdp2_gather or p.get('fsdp2_gather', 'fp32')}"
        if p.get("fsdp2_params", "tensors") != "tensors":  # other tensors; the per-tensor keys stay as they were
            key += f" params={p['fsdp2_params']}"
    if compile_wrapper:
        key += f" wrapper={compile_wrapper}"
    if t.get("optimizer", "torch") != "torch":  # another update's losses; torch's keys stay as they were
        key += f" opt={t['optimizer']}"
    return key


def read_verdicts(paths: list[Path]) -> dict[str, str]:
    """key -> verdict over parity CSVs written by tools.parity (the worst where several rows share a key).

    The noise row shares the reference's key but only measures run-to-run noise: its failure to run (e.g. out of
    memory) says nothing of the configuration, so it is left out."""
    by_key: dict[str, list[str]] = {}
    for path in paths:
        with Path(path).open(newline="") as f:
            for row in csv.DictReader(f):
                if row["config"] != "noise":
                    by_key.setdefault(row["key"], []).append(row["verdict"])
    return {key: worst(verdicts) for key, verdicts in by_key.items()}


def run_key(run_dir: Path) -> str | None:
    """The config_key of a finished train.py run folder; None without its config.json and summary.json."""
    config_path, summary_path = run_dir / "config.json", run_dir / "summary.json"
    if not (config_path.is_file() and summary_path.is_file()):
        return None
    summary = json.loads(summary_path.read_text())
    return config_key(json.loads(config_path.read_text()), summary["world_size"], summary.get("fsdp2_gather"),
                      summary.get("compile_wrapper"))


def verdict_of(run_dir: Path, verdicts: dict[str, str]) -> str:
    """The parity verdict of the run's configuration: `pass`, `fail`, `error`, `skipped`; `none` when no parity row
    checked it; `n/a` for a folder without a summary or one another trainer wrote (tools.hf_reference: parity
    checks train.py's configurations)."""
    summary = run_dir / "summary.json"
    if not summary.is_file() or json.loads(summary.read_text()).get("mode") not in TRAIN_MODES:
        return "n/a"
    key = run_key(run_dir)
    verdict = verdicts.get(key, "none") if key else "none"
    return "pass" if verdict in PASSING else verdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parity", type=Path, nargs="+", required=True, help="parity.csv files of tools.parity")
    p.add_argument("runs", type=Path, nargs="+", help="train.py run folders")
    args = p.parse_args(argv)
    verdicts = read_verdicts(args.parity)
    results = {run: verdict_of(run, verdicts) for run in args.runs}
    for run, verdict in results.items():
        print(f"{verdict:8s} {run}  [{run_key(run) or 'no configuration key'}]")
    return 0 if all(v == "pass" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
