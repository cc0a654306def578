"""What `tools.parity` writes: parity.csv, parity.md and one parity_<model>.png per model."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display
import matplotlib.pyplot as plt  # noqa: E402

from tools.common import markdown_table, write_csv  # noqa: E402
from tools.parity_verdict import Comparison, Curve  # noqa: E402


@dataclass
class RowResult:
    config: str
    model: str
    verdict: str  # reference | noise | pass | fail | error | skipped (tools.parity_verdict.VERDICTS)
    launcher: str = ""  # "python" or "torchrun xN"
    flags: tuple[str, ...] = ()  # the row's own train.py flags
    comparison: Comparison | None = None
    curve: Curve | None = None
    note: str = ""
    key: str = ""
    command: str = ""
    run_dir: str = ""
    log_tail: list[str] = field(default_factory=list)  # the last lines of a failed run's output

    def csv_row(self) -> dict[str, Any]:
        c = self.comparison
        return {"config": self.config, "model": self.model,
                "max_abs_dloss": c.max_abs_dloss if c else None, "final_dloss": c.final_dloss if c else None,
                "val_dloss": c.val_dloss if c else None, "tolerance": c.tolerance if c else None,
                "verdict": self.verdict, "steps": c.steps if c else None, "note": self.note, "key": self.key,
                "launcher": self.launcher, "flags": shlex.join(self.flags), "command": self.command,
                "run_dir": self.run_dir}


@dataclass(frozen=True)
class Tolerance:
    """One model's tolerance and how it was derived (for the Markdown)."""

    noise: float | None
    factor: float
    floor: float
    value: float
    precision: str


def _num(value: float | None, spec: str = ".2e") -> str:
    return "" if value is None else format(value, spec)


def markdown(results: list[RowResult], tolerances: dict[str, Tolerance], header: dict[str, str]) -> str:
    """The report: how it was run, the tolerance rule with each model's measured noise, one table per model,
    then the last output lines of every row that failed to run."""
    lines = ["# Loss parity: does every configuration train the same function as `--mode single` eager?", ""]
    lines += [f"- {name}: {value}" for name, value in header.items()]
    lines += ["", "## Tolerance rule", "",
              "`noise` is single eager at half the micro-batch with `--grad-accum 2`: the same function on the same "
              "global batches, only the floating-point summation order differs. noise = max over steps of "
              "|loss(noise) - loss(single)|; tolerance = max(floor, factor x noise). A row passes iff "
              "max over steps |loss - loss(single)| <= tolerance and |val loss - val loss(single)| <= tolerance. "
              "A row in another precision than the reference's (fp32 against the bf16 reference on a GPU) is not "
              "judged (verdict `precision`): its difference measures what bf16 rounding changes, not whether the "
              "code path is right; fp32 parity of every mode is checked on CPU by the test suite.", ""]
    for model, tol in tolerances.items():
        noise = "not measured (no usable noise run): the floor alone" if tol.noise is None else f"{tol.noise:.3e}"
        lines.append(f"- {model} ({tol.precision}): noise {noise}; factor {tol.factor:g}, floor {tol.floor:g} "
                     f"-> tolerance **{tol.value:.3e}**")
    for model in dict.fromkeys(r.model for r in results):
        rows = [{"config": r.config, "launcher": r.launcher, "flags": f"`{shlex.join(r.flags)}`" if r.flags else "",
                 "max abs dloss": _num(r.comparison and r.comparison.max_abs_dloss),
                 "final dloss": _num(r.comparison and r.comparison.final_dloss, "+.2e"),
                 "val dloss": _num(r.comparison and r.comparison.val_dloss, "+.2e"),
                 "tolerance": _num(r.comparison and r.comparison.tolerance),
                 "verdict": f"**{r.verdict}**" if r.verdict in ("fail", "error") else r.verdict,
                 "note": r.note.replace("|", "/")}
                for r in results if r.model == model]
        lines += ["", f"## {model}", "", markdown_table(rows, list(rows[0])), "",
                  f"![loss curves](parity_{model}.png)"]
    failed = [r for r in results if r.log_tail]
    if failed:
        lines += ["", "## Runs that failed: last output lines"]
        for r in failed:
            lines += ["", f"### {r.model} {r.config}", "", f"`{r.command}`", "", "```", *r.log_tail, "```"]
    return "\n".join(lines) + "\n"


def plot(model: str, results: list[RowResult], tol: Tolerance, title: str, path: Path) -> None:
    """Every finished row's loss curve over the reference's, and its difference to it within the +-tolerance band."""
    ref = next((r.curve for r in results if r.verdict == "reference"), None)
    if ref is None:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, height_ratios=[3, 2])
    top.plot(ref.steps, ref.losses, color="black", linewidth=3, label="single (reference)", zorder=1)
    for r in results:
        if r.curve is None or r.verdict == "reference" or r.curve.steps != ref.steps:
            continue
        style = "--" if r.verdict in ("fail", "error") else "-"
        label = f"{r.config} ({r.verdict})"
        top.plot(r.curve.steps, r.curve.losses, style, linewidth=1, label=label)
        bottom.plot(ref.steps, [a - b for a, b in zip(r.curve.losses, ref.losses)], style, linewidth=1, label=label)
    bottom.axhspan(-tol.value, tol.value, color="grey", alpha=0.2, label=f"+-tolerance {tol.value:.2e}")
    bottom.axhline(0, color="black", linewidth=1)
    # linear within the tolerance, logarithmic beyond: a diverged row does not flatten the passing ones
    bottom.set_yscale("symlog", linthresh=tol.value)
    span = max(ref.losses) - min(ref.losses)
    top.set_ylim(top.get_ylim()[0], max(ref.losses) + 0.2 * span)  # a diverging curve leaves the top panel
    top.set(ylabel="training loss", title=f"{model}: {title}")
    bottom.set(xlabel="step", ylabel="loss - reference loss")
    top.legend(fontsize=7, ncol=2)
    bottom.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: Path, results: list[RowResult], tolerances: dict[str, Tolerance], header: dict[str, str],
          tag: dict[str, str]) -> None:
    write_csv(out / "parity.csv", [r.csv_row() for r in results], tag)
    (out / "parity.md").write_text(markdown(results, tolerances, header))
    for model, tol in tolerances.items():
        plot(model, [r for r in results if r.model == model], tol, header["device"], out / f"parity_{model}.png")
