"""The results store: one row per measured run, the only place a published number lives.

`benchmarks/results/store/runs.csv` is long-format, one row per run (or per parity verdict). docs/results.md's
tables and the README's headline table are generated from it (`python -m tools.results_tables`); the raw file a
number came from stays addressable through the row's `raw` column. The tools that make runs append rows here
(`tools.train_sweep --store`, `tools.parity --store`, `tools.hf_reference --store`,
`tools.nanogpt_reference --store`).

`benchmarks/results/store/microbench.csv` is the second store, for the numbers that are not training runs (kernels,
attention backends, GEMMs, collectives, TP layers, per-op and profile breakdowns): one row per measured number,
read from the committed raw file its `raw` column names (`python -m tools.microbench_import` writes it).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "benchmarks" / "results" / "store" / "runs.csv"
MICROBENCH = ROOT / "benchmarks" / "results" / "store" / "microbench.csv"
DEVICE_OUT = "/root/out"  # a device call's output folder ($OUT), where its rows' raw paths point

# the schema, once: (column, what it holds)
SCHEMA: tuple[tuple[str, str], ...] = (
    ("id", "row id, never reused"),
    ("kind", "throughput (a train.py run) | reference (a model that is not ours) | parity (a loss-parity verdict)"),
    ("date", "YYYY-MM-DD the run was made"),
    ("commit", "the harness's commit (short hash), empty where the raw file does not name one"),
    ("call", "the device call (one machine, one session) the run belongs to; ratios only within one call"),
    ("device", "accelerator name"),
    ("gpus", "devices (processes) of the run"),
    ("model", "GPT-2 preset"),
    ("mode", "train.py --mode (single | baseline | hybrid), or the reference trainer"),
    ("engine", "torch | deepspeed | fsdp2 | hf | nanogpt"),
    ("tp", "tensor-parallel size"),
    ("sp", "1 with sequence parallelism"),
    ("zero_stage", "ZeRO stage, empty without ZeRO"),
    ("zero3_fetch", "DeepSpeed ZeRO-3's gather layout (block | flat), FSDP2's flat under --fsdp2-params flat, empty "
                    "elsewhere"),
    ("zero3_unit", "blocks per DeepSpeed ZeRO-3 leaf (or FSDP2 unit)"),
    ("compile", "eager | compile | deepcompile"),
    ("kernels", "--fused-kernels (none | triton | cuda)"),
    ("variant", "what else differs from the configuration key (profiled, a lever, a wrapper), free text"),
    ("seq_len", "tokens per sequence"),
    ("batch", "micro-batch per GPU"),
    ("tokens_per_s", "tokens per second, all devices"),
    ("mfu", "model FLOPs utilisation, 0..1"),
    ("peak_gib", "peak allocated memory, GiB, max over ranks"),
    ("device_busy_pct", "device busy share of a profiled step, where profiled"),
    ("parity", "pass | fail | none: the loss-parity verdict of this configuration in this call"),
    ("parity_file", "the parity CSV the verdict comes from (repository path)"),
    ("simulated", "1: one rank of a multi-GPU layout on one device (never beside real runs in a throughput table)"),
    ("superseded_by", "id of a newer row that replaces this one's configuration or measurement"),
    ("raw", "repository path of the raw artefact (CSV, log, profile) the number came from"),
    ("note", "conditions worth knowing (beside another run, cut before its summary, ...)"),
)
COLUMNS = tuple(name for name, _ in SCHEMA)
VERDICTS = ("pass", "fail", "none")

# the microbenchmark store's schema, once: one row per measured number
MICROBENCH_SCHEMA: tuple[tuple[str, str], ...] = (
    ("id", "row id, never reused"),
    ("date", "YYYY-MM-DD the number was measured"),
    ("commit", "the harness's commit (short hash), empty where the raw file does not name one in the repository"),
    ("call", "the device call the number belongs to (the raw file's call, else its start time); ratios only within "
             "one"),
    ("device", "accelerator name"),
    ("benchmark", "kernels | liger | attention | gemm | gemm-epilogue | gemm-mlp | gemm-ncu | collectives | tp-comm "
                  "| tp-scaling | per-op | profile"),
    ("op", "what was measured (kernel and pass, GEMM shape's role, collective, layer, profile category)"),
    ("implementation", "whose code ran it (ours-triton, ours-cuda-..., eager, inductor, liger, cublas, nccl, ...)"),
    ("shape", "tensor shape, message size and ranks, or empty"),
    ("metric", "unit of value (ms, us, GB/s, TFLOP/s, MiB, pct, ...)"),
    ("value", "the number, as the raw file has it"),
    ("raw", "repository path of the raw CSV/MD/TXT/JSON the number was read from"),
    ("superseded_by", "id of a newer row that replaces this measurement"),
    ("note", "conditions worth knowing"),
)
MICROBENCH_COLUMNS = tuple(name for name, _ in MICROBENCH_SCHEMA)


def add_store_arguments(parser: Any) -> None:
    """--store / --call, the same on every tool that makes runs."""
    parser.add_argument("--store", type=Path, nargs="?", const=STORE, default=None,
                        help=f"append the runs to the results store (default file: {STORE.relative_to(ROOT)})")
    parser.add_argument("--call", default="", help="the device call's name for --store rows (ratios stay within one)")


def read_rows(path: Path = STORE) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def append_rows(rows: Iterable[Mapping[str, Any]], path: Path = STORE,
                columns: tuple[str, ...] = COLUMNS) -> list[int]:
    """Append rows (of `columns`: COLUMNS, or MICROBENCH_COLUMNS for the microbenchmark store; the id is assigned
    here) and return their ids."""
    existing = read_rows(path)
    next_id = max((int(r["id"]) for r in existing), default=0) + 1
    ids, out = [], []
    for row in rows:
        unknown = set(row) - set(columns)
        if unknown:
            raise ValueError(f"results store: unknown columns {sorted(unknown)}")
        if "parity" in columns and row.get("parity", "none") not in VERDICTS:
            raise ValueError(f"results store: parity must be one of {VERDICTS}, not {row['parity']!r}")
        if "value" in columns and _cell(row.get("value")) == "":
            raise ValueError("results store: a microbenchmark row needs a value")
        out.append({**{c: _cell(row.get(c)) for c in columns}, "id": str(next_id)})
        ids.append(next_id)
        next_id += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(out)
    return ids


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def repo_path(path: Path | str) -> str:
    """A path relative to the repository when it is inside it (rows must stay valid in any checkout)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def row_from_summary(summary: Mapping[str, Any], *, call: str, raw: Path | str, parity: str = "none",
                     parity_file: Path | str | None = None, kind: str = "throughput", variant: str = "",
                     note: str = "", commit: str | None = None) -> dict[str, Any]:
    """A store row from a run's summary.json (train.py's or a reference trainer's); `commit`: the one that made the
    run, where it is not this checkout's HEAD."""
    mode = summary.get("mode", "")
    engine = summary.get("zero_engine") or ("deepspeed" if mode == "hybrid" else "torch")
    if kind == "reference":
        engine = summary.get("engine", "hf")
    compile_ = summary.get("compile") or "eager"
    compile_ = {"off": "eager", "model": "compile", "blocks": "compile"}.get(compile_, compile_)
    return {
        "kind": kind, "date": datetime.date.today().isoformat(), "commit": commit or git_commit(), "call": call,
        "device": summary.get("device", ""), "gpus": summary.get("world_size", 1), "model": summary.get("model", ""),
        "mode": mode, "engine": engine, "tp": summary.get("tp_size", 1),
        "sp": int(bool(summary.get("sequence_parallel"))),
        "zero_stage": summary.get("zero_stage") if mode == "hybrid" else None,
        "zero3_fetch": summary.get("zero3_fetch") or ("flat" if summary.get("fsdp2_params") == "flat" else None),
        "zero3_unit": summary.get("zero3_unit_blocks") or summary.get("fsdp2_unit_blocks"),
        "compile": compile_, "kernels": summary.get("fused_kernels", "none"), "variant": variant,
        "seq_len": summary.get("seq_len"), "batch": summary.get("batch_size_per_gpu"),
        "tokens_per_s": summary.get("tokens_per_s"), "mfu": summary.get("mfu"),
        "peak_gib": summary.get("mem/peak_allocated_gib"), "device_busy_pct": summary.get("profile/device_busy_pct"),
        "parity": parity if parity in VERDICTS else "none",
        "parity_file": repo_path(parity_file) if parity_file else "", "simulated": int(bool(summary.get("simulated"))),
        "superseded_by": "", "raw": repo_path(raw), "note": note,
    }


def merge_device_rows(device_store: Path, call: str, folder: Path, commit: str, device_out: str = DEVICE_OUT,
                      path: Path = STORE) -> list[int]:
    """Append the rows of device call `call` from the call's copy of the store (`device_store`), renumbered, with the
    paths under the call's output folder (`device_out`, the device's $OUT) moved to `folder` (where the call's files
    are committed) and `commit` set: the device copy's git may name another. A call already in this store is refused
    (its rows would be there twice)."""
    if any(r["call"] == call for r in read_rows(path)):
        raise ValueError(f"the store already holds rows of call {call!r}")
    prefix = device_out.rstrip("/") + "/"

    def moved(value: str) -> str:
        return repo_path(folder / value[len(prefix):]) if value.startswith(prefix) else value

    rows = [{**{c: r[c] for c in COLUMNS if c != "id"}, "raw": moved(r["raw"]),
             "parity_file": moved(r["parity_file"]), "commit": commit}
            for r in read_rows(device_store) if r["call"] == call]
    return append_rows(rows, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.results_store", description="Maintain the results store.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="append a device call's new rows from its copy of the store")
    m.add_argument("device_store", type=Path, help="the runs.csv the call appended to (fetched from the device)")
    m.add_argument("--call", required=True, help="the call's name (its rows' call column)")
    m.add_argument("--folder", type=Path, required=True,
                   help="where the call's output folder is committed (its raw and parity paths move there)")
    m.add_argument("--commit", required=True, help="the commit that ran (short hash)")
    m.add_argument("--device-out", default=DEVICE_OUT, help="the call's output folder on the device ($OUT)")
    m.add_argument("--store", type=Path, default=STORE, help="the store to append to")
    args = p.parse_args(argv)
    if not args.device_store.is_file():
        p.error(f"{args.device_store} does not exist")
    try:
        ids = merge_device_rows(args.device_store, args.call, args.folder, args.commit, args.device_out, args.store)
    except ValueError as err:
        p.error(str(err))
    print(f"appended rows {ids[0]}-{ids[-1]}" if ids else f"no rows of call {args.call!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
