"""The README's headline table and docs/results.md's tables, generated from the results store.

    python -m tools.results_tables            # rewrite the generated blocks of README.md and docs/results.md
    python -m tools.results_tables --check    # exit 1 when a committed block differs from the store's

A block sits between `<!-- generated:NAME -->` and `<!-- end generated:NAME -->`; TABLES says which store rows
(by id) each block shows and which row a ratio divides by. The rules, enforced here rather than by hand:
a ratio divides two rows of one call (the same date, device and call) or is refused; a row without a passing
verdict (and its parity file) is labelled "no verdict"; a row whose configuration a newer row replaces is
labelled "superseded by #N"; a simulated row (one rank of a multi-GPU layout on one device) never enters a
throughput table.

docs/results.md's last section comes from the second store, benchmarks/results/store/microbench.csv (one row per
measured number): MICRO_TABLES says which rows each block shows (one benchmark, its op x implementation grid) and
which cell a ratio divides by; the same rule holds there: a ratio across calls is refused.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.results_store import MICROBENCH, ROOT, STORE, read_rows

Row = Mapping[str, str]


class CrossCallRatio(ValueError):
    """A ratio between rows of two calls: host and machine differ between calls, so it is refused."""


@dataclass(frozen=True)
class Table:
    """Store rows shown in one block: (row id, id of the row its ratio divides by, or None)."""
    rows: Sequence[tuple[int, int | None]]
    columns: tuple[str, ...] = ("row", "configuration", "devices", "batch", "tok/s", "MFU", "peak GiB", "ratio",
                                "verdict", "call")
    notes: Sequence[str] = field(default_factory=tuple)


def call_of(row: Row) -> tuple[str, str, str]:
    return row["date"], row["device"], row["call"]


def verified(row: Row) -> bool:
    return row["parity"] == "pass" and bool(row["parity_file"])


def ratio(row: Row, base: Row, column: str = "tokens_per_s") -> float:
    """row's tokens/s (or a microbenchmark row's value) over base's, only within one call."""
    if call_of(row) != call_of(base):
        raise CrossCallRatio(f"row {row['id']} (call {' '.join(call_of(row))}) against row {base['id']} "
                             f"(call {' '.join(call_of(base))}): a ratio divides two rows of one call")
    return float(row[column]) / float(base[column])


def configuration(row: Row) -> str:
    engine, tp = row["engine"], int(row["tp"] or 1)
    if engine == "hf":
        text = "Hugging Face GPT2LMHeadModel, DDP"
    elif engine == "nanogpt":
        text = "nanoGPT-style reference, DDP"
    elif engine == "fsdp2":
        text = f"FSDP2 ({'flat, ' if row['zero3_fetch'] == 'flat' else ''}units of {row['zero3_unit']})"
    elif engine == "deepspeed" and row["zero_stage"] == "3":
        layout = {"block": "per block", "flat": "flat"}.get(row["zero3_fetch"], row["zero3_fetch"])
        unit = f", units of {row['zero3_unit']}" if row["zero3_fetch"] == "flat" else ""
        text = f"DeepSpeed ZeRO-3 ({layout}{unit})"
    elif engine == "deepspeed":
        text = f"DeepSpeed ZeRO-{row['zero_stage']}"
    else:
        text = {"single": "single", "baseline": "DDP"}.get(row["mode"], row["mode"])
    if tp > 1:
        text += f" + TP{tp}" + (" + SP" if row["sp"] == "1" else "")
    if engine not in ("hf", "nanogpt"):
        text += {"compile": ", `--compile`", "deepcompile": ", DeepCompile", "eager": ", eager"}[row["compile"]]
    if row["kernels"] not in ("", "none"):
        text += f", `--fused-kernels {row['kernels']}`"
    if row["variant"]:
        text += f" ({row['variant']})"
    return text


def label(row: Row) -> str:
    """The verdict cell: pass with its file, else what the number lacks."""
    if row["kind"] == "reference":
        text = "reference model, not gated"
    elif verified(row):
        text = f"[pass](../{row['parity_file']})"
    else:
        text = "**no verdict**"
    return text + superseded_note(row)


def superseded_note(row: Row) -> str:
    """What a cell adds where a newer row replaces this one's configuration."""
    return f"; **superseded by #{row['superseded_by']}**" if row["superseded_by"] else ""


def _k(value: str) -> str:
    return f"{float(value) / 1000:.1f}k" if value else ""


def cells(row: Row, base: Row | None) -> dict[str, str]:
    return {
        "row": row["id"], "configuration": configuration(row),
        "devices": f"{row['gpus']}× {row['device'].replace('NVIDIA ', '').replace(' 80GB HBM3', '')}",
        "batch": row["batch"], "tok/s": _k(row["tokens_per_s"]),
        "MFU": f"{float(row['mfu']) * 100:.1f}%" if row["mfu"] else "",
        "peak GiB": f"{float(row['peak_gib']):.1f}" if row["peak_gib"] else "",
        "ratio": f"{ratio(row, base):.2f}× #{base['id']}" if base is not None else "",
        "verdict": label(row), "call": f"{row['date']} {row['call']}",
        "note": row["note"].replace("|", "\\|"),  # a note may hold |dloss|
    }


def render(table: Table, rows: Mapping[int, Row], link_prefix: str = "../") -> str:
    """A Markdown table; simulated rows are left out of it (they never sit beside real runs)."""
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    for row_id, base_id in table.rows:
        row = rows[row_id]
        if row["simulated"] == "1":
            continue
        c = cells(row, rows[base_id] if base_id is not None else None)
        c["verdict"] = c["verdict"].replace("](../", f"]({link_prefix}")
        lines.append("| " + " | ".join(c[col] for col in table.columns) + " |")
    return "\n".join([*lines, *table.notes]) + "\n"


SIMULATED_COLUMNS = ("row", "configuration", "GPUs simulated", "batch", "MFU, communication free", "device busy",
                     "peak GiB", "raw", "call", "note")


def simulated(rows: Mapping[int, Row]) -> str:
    """Every simulated row of the store in a table of its own: one rank's compute, memory and host path, whose
    MFU assumes free communication (never a throughput beside real runs). Its host path is the host CPU's too, so
    the row's note says where a call's host differed."""
    lines = ["| " + " | ".join(SIMULATED_COLUMNS) + " |", "|" + "---|" * len(SIMULATED_COLUMNS)]
    for row in rows.values():
        if row["simulated"] != "1" or row["kind"] != "throughput":
            continue
        common = cells(row, None)
        c = {**common, "GPUs simulated": row["gpus"], "MFU, communication free": common["MFU"],
             "device busy": f"{float(row['device_busy_pct']):.1f}%" if row["device_busy_pct"] else "",
             "raw": f"[table](../{row['raw'].replace('.csv', '.md')})" + superseded_note(row)}
        lines.append("| " + " | ".join(c[col] for col in SIMULATED_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


# the host-path cuts of issue 53, each measured against what it replaced on one simulated rank in one call:
# (row before, row after, the cut)
SIMULATED_CUTS: tuple[tuple[int, int, str], ...] = (
    (282, 283, "DeepSpeed leaf units of 12 blocks (`--zero3-unit-blocks 12`)"),
    (299, 300, "FSDP2 over flat unit tensors (`--fsdp2-params flat`)"),
)
CUT_COLUMNS = ("cut", "layout (rank 0 of 4)", "rows", "MFU, communication free", "ratio", "device busy",
               "step (profiled)", "host op time", "GEMM", "elementwise", "collective calls", "call")


def raw_line(row: Row, **same: str) -> Mapping[str, str]:
    """The row's one line of its raw CSV (the `raw` file): the line whose tokens/s is the row's (rounded there to
    whole tokens) and whose columns in `same` hold the given values."""
    lines = [line for line in read_rows(ROOT / row["raw"]) if all(line[k] == v for k, v in same.items())
             and abs(float(line["tokens_per_s"]) - float(row["tokens_per_s"])) <= 0.5]
    if len(lines) != 1:
        raise ValueError(f"row #{row['id']}: {len(lines)} lines of {row['raw']} match its tokens/s and {same}")
    return lines[0]


def profile_of(row: Row) -> Mapping[str, str]:
    """The simulated row's line of its call's table (benchmarks.simulated_ranks' CSV): its profile breakdown."""
    return raw_line(row, batch=row["batch"])


def profile_column(profiles: Sequence[Mapping[str, str]], column: str, unit: str = " ms") -> str:
    """One profile column of simulated rows, in order: `before -> after unit` (or one value)."""
    return " -> ".join(f"{float(p[column]):.1f}" for p in profiles) + unit


def simulated_cuts(rows: Mapping[int, Row]) -> str:
    """SIMULATED_CUTS: each cut's simulated rank before and after, in one call, with the profile's host and device
    time a step (ms, of the profiled steps) beside the MFU of the timed ones."""
    lines = ["| " + " | ".join(CUT_COLUMNS) + " |", "|" + "---|" * len(CUT_COLUMNS)]
    for before_id, after_id, cut in SIMULATED_CUTS:
        before, after = rows[before_id], rows[after_id]
        mfu = ratio(after, before, "mfu")  # refuses two calls
        pair = functools.partial(profile_column, (profile_of(before), profile_of(after)))
        c = {"cut": cut, "layout (rank 0 of 4)": configuration(after), "rows": f"#{before_id} -> #{after_id}",
             "MFU, communication free": pair("mfu_pct", "%"), "ratio": f"{mfu:.2f}×",
             "device busy": pair("device_busy_pct", "%"), "step (profiled)": pair("step_ms"),
             "host op time": pair("host_op_ms"), "GEMM": pair("gemm_ms"), "elementwise": pair("elementwise/other_ms"),
             "collective calls": pair("collective_calls", ""), "call": f"{after['date']} {after['call']}"}
        lines.append("| " + " | ".join(c[col] for col in CUT_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


# issue 53's simulated layouts (rank 0 of 4, GPT-2 Large): the first row measured and the newest, each with its own
# call's profile; two calls (and code versions) apart, so no ratio: each call's host differs
SIMULATED_BEFORE_AFTER: tuple[tuple[int | None, int, str], ...] = (
    (222, 309, ""), (223, 308, "FSDP2 over its tensors -> flat unit tensors"), (219, 305, ""),
    (221, 313, "FSDP2 over its tensors -> flat unit tensors; CUPTI detached after the profile"), (220, 284, ""),
    (None, 301, ""), (None, 312, ""), (None, 311, ""))
BEFORE_AFTER_COLUMNS = ("layout (rank 0 of 4)", "batch", "what changed", "rows", "MFU, communication free",
                        "device busy", "step (profiled)", "host op time", "GEMM", "elementwise", "elementwise / GEMM",
                        "calls")
# what a before/after pair must share: one layout at one batch
SAME_LAYOUT = ("engine", "tp", "sp", "gpus", "model", "batch", "seq_len", "compile", "kernels")


def simulated_before_after(rows: Mapping[int, Row]) -> str:
    """SIMULATED_BEFORE_AFTER: each layout's first and newest simulated rank, the profile's breakdown beside the MFU
    of the timed steps (`before -> after`, or the newest alone where no earlier row ran)."""
    lines = ["| " + " | ".join(BEFORE_AFTER_COLUMNS) + " |", "|" + "---|" * len(BEFORE_AFTER_COLUMNS)]
    for before_id, after_id, change in SIMULATED_BEFORE_AFTER:
        ids = [i for i in (before_id, after_id) if i is not None]
        pair = [rows[i] for i in ids]
        if any(r["simulated"] != "1" for r in pair) or any(pair[0][k] != r[k] for r in pair for k in SAME_LAYOUT):
            raise ValueError(f"rows {ids} are not one simulated layout at one batch ({', '.join(SAME_LAYOUT)})")
        profiles = [profile_of(r) for r in pair]
        shown = functools.partial(profile_column, profiles)
        after = rows[after_id]
        c = {"layout (rank 0 of 4)": configuration(after), "batch": after["batch"], "what changed": change,
             "rows": " -> ".join(f"#{i}" for i in ids), "MFU, communication free": shown("mfu_pct", "%"),
             "device busy": shown("device_busy_pct", "%"), "step (profiled)": shown("step_ms"),
             "host op time": shown("host_op_ms"), "GEMM": shown("gemm_ms"),
             "elementwise": shown("elementwise/other_ms"),
             "elementwise / GEMM": " -> ".join(f"{float(p['elementwise/other_ms']) / float(p['gemm_ms']):.2f}"
                                               for p in profiles),
             "calls": " -> ".join(r["call"] for r in pair)}
        lines.append("| " + " | ".join(c[col] for col in BEFORE_AFTER_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


# issue 55's end-to-end table: single GPT-2 Large under --compile with each --fused-kernels set, the three rows of one
# call at one batch (none, triton, cuda); a group is one call's sweep, so its ratios divide rows of that call
KERNEL_SETS: tuple[tuple[int, int, int], ...] = ((317, 318, 319), (331, 330, 329), (341, 342, 343), (320, 321, 322),
                                                 (337, 336, 335), (344, 345, 346), (326, 327, 328), (350, 351, 352))
PROFILE_CATEGORIES = {"GEMM": "gemm", "elementwise": "elementwise/other", "attention": "attention",
                      "optimizer": "optimizer"}
PROFILE_COLUMNS = (*PROFILE_CATEGORIES, "device busy")
KERNEL_SET_COLUMNS = ("batch", "row", "`--fused-kernels`", "tok/s", "MFU", "peak GiB", "ratio", "verdict", "call",
                      *PROFILE_COLUMNS)


def run_profile(row: Row) -> dict[str, str]:
    """The profiled steps of a train_sweep row (ms a step by category, device busy share), from its run's
    profile_breakdown.json beside the row's sweep.csv (the `raw` file); blank cells for a run without --profile."""
    if row["variant"] != "profiled":
        return dict.fromkeys(PROFILE_COLUMNS, "")
    line = raw_line(row, batch_per_gpu=row["batch"], fused_kernels=row["kernels"])
    path = (ROOT / row["raw"]).parent / "runs" / line["run"] / "profile_breakdown.json"
    profile = json.loads(path.read_text())
    ms = profile["ms_per_step"]
    return {**{column: f"{ms[key]:.1f} ms" for column, key in PROFILE_CATEGORIES.items()},
            "device busy": f"{profile['device_busy_pct']:.1f}%"}


def kernel_sets(rows: Mapping[int, Row], link_prefix: str = "../") -> str:
    """KERNEL_SETS: none, triton and cuda at one batch in one call, each against none, with the profiled steps'
    device time by category where the runs were profiled."""
    lines = ["| " + " | ".join(KERNEL_SET_COLUMNS) + " |", "|" + "---|" * len(KERNEL_SET_COLUMNS)]
    for group in KERNEL_SETS:
        trio = [rows[i] for i in group]
        if [r["kernels"] for r in trio] != ["none", "triton", "cuda"] or any(
                r["batch"] != trio[0]["batch"] or r["mode"] != "single" or r["compile"] != "compile" for r in trio):
            raise ValueError(f"rows {list(group)} are not single --compile none, triton, cuda at one batch")
        for row in trio:
            c = cells(row, None)
            share = "" if row is trio[0] else f"{ratio(row, trio[0]):.3f}× #{trio[0]['id']}"  # refuses two calls
            c = {**c, "`--fused-kernels`": row["kernels"], "ratio": share,
                 "verdict": c["verdict"].replace("](../", f"]({link_prefix}"), **run_profile(row)}
            lines.append("| " + " | ".join(c[col] for col in KERNEL_SET_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def by_id(rows: Iterable[Row]) -> dict[int, Row]:
    return {int(r["id"]): r for r in rows}


def targets(rows: Mapping[int, Row]) -> str:
    """The performance targets against the best current row with a verdict (superseded and unverified left out)."""
    live = [r for r in rows.values() if r["kind"] == "throughput" and verified(r) and not r["superseded_by"]
            and r["simulated"] != "1" and r["mfu"]]

    def best(pred) -> Row | None:
        found = [r for r in live if pred(r)]
        return max(found, key=lambda r: float(r["mfu"])) if found else None

    def show(row: Row | None, goal: float) -> tuple[str, str]:
        if row is None:
            return "no current row", "not measured"
        mfu = float(row["mfu"]) * 100
        return (f"{mfu:.1f}%: #{row['id']} {configuration(row)}, batch {row['batch']}, {row['gpus']}× "
                f"{row['device'].replace('NVIDIA ', '').replace(' 80GB HBM3', '')} ({row['date']} {row['call']})",
                "met" if mfu >= goal else f"missed by {goal - mfu:.1f} points")

    zero3 = lambda r: r["zero_stage"] == "3" and r["tp"] == "1"  # noqa: E731
    lines = ["| target | best current row with a verdict | status |", "|---|---|---|"]
    for name, pred, goal in (
            ("best configuration ≥ 55% MFU", lambda r: True, 55.0),
            ("ZeRO-3 ≥ 50% MFU at its best batch", zero3, 50.0),
            ("ZeRO-3 ≥ 30% MFU at batch 8", lambda r: zero3(r) and r["batch"] == "8", 30.0),
            ("ZeRO-3 + TP2 ≥ 45% MFU", lambda r: r["zero_stage"] == "3" and r["tp"] == "2", 45.0)):
        lines.append(f"| {name} | " + " | ".join(show(best(pred), goal)) + " |")
    pairs = []
    for hf in (r for r in rows.values() if r["engine"] == "hf"):
        ours = [r for r in live if call_of(r) == call_of(hf) and r["batch"] == hf["batch"]]
        pairs += [f"{configuration(r)} {ratio(r, hf):.2f}× (#{r['id']}/#{hf['id']}, {r['gpus']}× "
                  f"{r['device'].replace('NVIDIA ', '').replace(' 80GB HBM3', '')}, {r['date']} {r['call']})"
                  for r in ours]
    lines.append("| every mode ≥ 2.5× Hugging Face at the same batch, same call | " + ("; ".join(pairs) or "none") +
                 " | " + ("met" if pairs and all("×" in p and float(p.split("× ")[0].split()[-1]) >= 2.5
                                                 for p in pairs) else "missed") + " |")
    return "\n".join(lines) + "\n"


def span(rows: Mapping[int, Row]) -> str:
    """The dates and devices the store's throughput rows cover, as one line."""
    real = [r for r in rows.values() if r["simulated"] != "1"]
    dates = sorted(r["date"] for r in real)
    devices = sorted({r["device"] for r in real})
    return (f"{len(real)} runs, {dates[0]} to {dates[-1]}, on {' and '.join(devices)} "
            f"(1 to {max(int(r['gpus']) for r in real)} GPUs of one host).\n")


def pairs(*ids: int, vs: int | None = None) -> list[tuple[int, int | None]]:
    return [(i, None if i == vs else vs) for i in ids]


TABLES: dict[str, Table] = {
    "headline": Table(
        [*pairs(191, 190, 192, vs=191), *pairs(153, 154, 155, vs=153), *pairs(289, 290, vs=289),
         *pairs(344, 345, 346, vs=344)],
        columns=("row", "configuration", "devices", "batch", "tok/s", "MFU", "peak GiB", "ratio", "verdict")),
    "two-gpus": Table([*pairs(191, 190, 192, vs=191), *pairs(194, 193, vs=194), (200, None), (198, None),
                       (199, None), (195, None), (197, None)]),
    "tp-wrapper": Table([*pairs(175, 176, vs=175), *pairs(178, 177, vs=178), *pairs(180, 179, 181, 183, vs=180),
                         (182, None), (184, None), *pairs(185, 186, vs=185), (187, None), (188, None), (189, None)]),
    "four-gpus": Table([*pairs(153, 154, 155, 156, 157, vs=153), *pairs(161, 163, 164, 162, vs=161),
                        *pairs(169, 168, vs=169), *pairs(160, 159, 158, vs=160), (165, None), (166, None),
                        (167, None)]),
    "four-h200": Table([*pairs(212, 213, 214, vs=212), *pairs(206, 207, 205, 208, vs=206), (209, None), (210, None),
                        (211, None), *pairs(202, 201, vs=202), *pairs(204, 203, vs=204),
                        *pairs(217, 216, 215, 218, vs=217)]),
    "four-gpus-earlier": Table([*pairs(141, 142, 143, vs=141), *pairs(144, 145, 146, 147, vs=144),
                                *pairs(148, 149, 150, 151, vs=148), (152, None), *pairs(171, 170, vs=171),
                                *pairs(172, 173, 174, vs=172)]),
    "one-gpu-flat": Table([*pairs(107, 108, vs=107), *pairs(109, 110, vs=109), *pairs(104, 105, vs=104),
                           (103, None), (106, None), *pairs(126, 125, vs=126), *pairs(130, 128, 129, vs=130),
                           *pairs(131, 132, 133, vs=131), (135, None), (134, None), *pairs(136, 137, vs=136),
                           (140, None), *pairs(138, 139, vs=138), *pairs(119, 118, 121, 120, vs=119),
                           *pairs(111, 112, vs=112)]),
    "one-gpu-zero": Table([*pairs(66, 70, 69, 68, 67, 71, vs=66), *pairs(75, 77, 76, vs=75),
                           *pairs(81, 82), (85, None), (78, None), (79, None),
                           *pairs(47, 48, 49, 50, vs=47), *pairs(72, 74, 73, vs=72), *pairs(83, 84), (86, None),
                           (58, None), *pairs(87, 88, vs=87), *pairs(91, 92, 93, vs=91), *pairs(37, 94, vs=37),
                           (95, None), (30, None), (80, None), *pairs(100, 96, 97, 98, 99, 101, vs=100),
                           (102, None)]),
    "one-gpu-kernels": Table([*pairs(1, 2, 3, 4, 5, vs=1), (6, None), (7, None), *pairs(13, 14, 15, vs=13),
                              *pairs(11, 12, vs=11), *pairs(24, 25, vs=24), *pairs(26, 27, vs=26),
                              *pairs(29, 28, vs=29),
                              *pairs(30, 31, vs=30), *pairs(32, 33, vs=32), *pairs(34, 35, vs=34), (36, None),
                              *pairs(23, 20, 22, 21, 19, vs=23)]),
    "one-h200-kernels": Table([*pairs(230, 231, 232, vs=230), *pairs(235, 237, 236, vs=235),
                               *pairs(243, 245, 244, vs=243), (246, None), *pairs(256, 255, 257, vs=256),
                               *pairs(260, 261, vs=260), *pairs(262, 263, vs=262), *pairs(266, 267, vs=266),
                               *pairs(271, 272, 273, vs=271), *pairs(274, 275, vs=274), *pairs(280, 281, vs=280),
                               *pairs(278, 279, vs=278)],
                              columns=(*Table.columns, "note")),
    "one-h200-ws1": Table([*pairs(289, 290, 291, 292, vs=289), *pairs(296, 297, 298, vs=296)],
                          columns=(*Table.columns, "note")),
}
KEY = ("op", "implementation", "shape", "metric")  # a microbenchmark row's key within its call


@dataclass(frozen=True)
class MicroTable:
    """One benchmark's grid from the microbenchmark store: a line per call and key (less `across`), a column per
    value of `across` (in `columns`' order); a cell's ratio divides it by the row its key becomes under `base`."""
    benchmark: str
    columns: tuple[str, ...]
    across: str = "implementation"
    where: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    base: Mapping[str, str] = field(default_factory=dict)
    ratio: str = ""  # "speedup": base / cell, "over": cell / base, "share": cell / base in %
    ratio_metrics: tuple[str, ...] = ()  # the metrics that get a ratio (empty: all)


RATIO_WORDS = {"speedup": "the base's value over the cell's", "over": "the cell's value over the base's",
               "share": "the cell's value as a share of the base's"}


def _num(value: str) -> str:
    v = float(value)
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _device(row: Row) -> str:
    return row["device"].replace("NVIDIA ", "").replace(" 80GB HBM3", "")


def micro_base(row: Row, table: MicroTable, rows: Sequence[Row]) -> Row | None:
    """The row a cell's ratio divides by: its key under table.base, in its own call if there is one; a base found
    only in another call is returned so that ratio() refuses it."""
    key = {**{f: row[f] for f in KEY}, **table.base}
    found = [r for r in rows if r["benchmark"] == row["benchmark"] and all(r[f] == key[f] for f in KEY)]
    return next((r for r in found if call_of(r) == call_of(row)), found[0] if found else None)


def micro_cell(row: Row, table: MicroTable, rows: Sequence[Row]) -> str:
    text = _num(row["value"])
    base = micro_base(row, table, rows) if table.ratio else None
    if base is not None and base is not row and (not table.ratio_metrics or row["metric"] in table.ratio_metrics):
        x = ratio(row, base, "value")
        text += {"speedup": f" ({1 / x:.2f}×)", "over": f" ({x:.2f}×)", "share": f" ({x * 100:.1f}%)"}[table.ratio]
    if row["superseded_by"]:
        text += f" **superseded by #{row['superseded_by']}**"
    return text


def render_micro(table: MicroTable, rows: Sequence[Row], link_prefix: str = "../") -> str:
    """A Markdown grid of one benchmark's rows; the key fields every line shares go in a line below it."""
    picked = [r for r in rows if r["benchmark"] == table.benchmark and r[table.across] in table.columns
              and all(r[f] in allowed for f, allowed in table.where.items())]
    fields = [f for f in KEY if f != table.across]
    lines: dict[tuple, dict[str, Row]] = {}
    for r in picked:
        cells = lines.setdefault((call_of(r), *(r[f] for f in fields)), {})
        if r[table.across] in cells:
            raise ValueError(f"microbench rows {cells[r[table.across]]['id']} and {r['id']} share one cell")
        cells[r[table.across]] = r
    varying = [f for i, f in enumerate(fields) if len({k[1 + i] for k in lines}) > 1]
    shared = [f"{f} {picked[0][f]}" for f in fields if f not in varying and picked[0][f]]
    head = [*varying, *table.columns, "call", "raw"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cells in lines.values():
        first = next(iter(cells.values()))
        raws = sorted({r["raw"] for r in cells.values()})
        out.append("| " + " | ".join([
            *(first[f] for f in varying),
            *(micro_cell(cells[c], table, rows) if c in cells else "" for c in table.columns),
            f"{first['date']} {first['call']}, {_device(first)}",
            ", ".join(f"[{Path(r).name}]({link_prefix}{r})" for r in raws)]) + " |")
    notes = [f"From the microbenchmark store's rows #{min(int(r['id']) for r in picked)} to "
             f"#{max(int(r['id']) for r in picked)}" + (f"; {'; '.join(shared)}" if shared else "") + "."]
    if table.ratio:
        base = ", ".join(f"{k} {v}" for k, v in table.base.items() if v)
        only = f" ({', '.join(table.ratio_metrics)} only)" if table.ratio_metrics else ""
        notes.append(f"In brackets{only}: {RATIO_WORDS[table.ratio]}, the base being the same line's {base}, "
                     "in the same call.")
    return "\n".join([*out, "", " ".join(notes)]) + "\n"


def sizes(ranks: Iterable[int], *names: str) -> tuple[str, ...]:
    return tuple(f"{n} ranks, {s} float32" for n in ranks for s in names)


MICRO_TABLES: dict[str, MicroTable] = {
    "kernels-time": MicroTable("kernels", ("eager", "inductor", "ours-triton", "ours-cuda"), where={"metric": ("ms",)},
                               base={"implementation": "eager"}, ratio="speedup"),
    "kernels-bandwidth": MicroTable("kernels", ("eager", "inductor", "ours-triton", "ours-cuda"),
                                    where={"metric": ("GB/s",)}, ratio="share",
                                    base={"op": "device-to-device copy", "implementation": "torch", "shape": ""}),
    "kernels-memory": MicroTable("kernels", ("eager", "inductor", "ours-triton", "ours-cuda"),
                                 where={"metric": ("MiB",)}, base={"implementation": "eager"}, ratio="over"),
    "liger": MicroTable("liger", ("eager", "inductor", "ours-triton", "ours-cuda", "liger", "liger-fp32acc"),
                        where={"metric": ("ms", "MiB")}, base={"implementation": "ours-triton"}, ratio="over"),
    "lm-head-chunks": MicroTable("lm-head-chunks", ("eager", "inductor", *(f"ours-triton 2^{k}" for k in range(26, 31)),
                                                    "ours-triton one-chunk"),
                                 base={"implementation": "inductor"}, ratio="over"),
    "attention": MicroTable("attention", ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math"),
                            base={"implementation": "sdpa-cudnn"}, ratio="over", ratio_metrics=("ms", "MiB")),
    "gemm-ladder": MicroTable("gemm", ("cublas", "ours-triton", "ours-cuda-naive", "ours-cuda-smem",
                                       "ours-cuda-regblock", "ours-cuda-wmma", "ours-cuda-mma128x128",
                                       "ours-cuda-mma128x256"),
                              where={"call": ("09:53Z",)}, base={"implementation": "cublas"}, ratio="share"),
    "gemm-hopper": MicroTable("gemm", ("cublas", "ours-cuda-wgmma", "ours-cuda-wgmma-persistent"),
                              where={"call": ("13:26Z",)}, base={"implementation": "cublas"}, ratio="share"),
    "gemm-ncu": MicroTable("gemm-ncu", ("ours-cuda-wgmma-persistent", "cublas"), base={"implementation": "cublas"},
                           ratio="over", ratio_metrics=("us",)),
    "gemm-epilogue": MicroTable("gemm-epilogue", ("eager", "cublas-addmm+gelu", "cublas+ours-triton", "cublaslt",
                                                  "ours-cuda-wgmma-persistent"),
                                base={"implementation": "cublas-addmm+gelu"}, ratio="speedup"),
    "gemm-mlp": MicroTable("gemm-mlp", ("eager", "eager-fp32-sum", "ours-cuda-wgmma-persistent"),
                           base={"implementation": "eager"}, ratio="speedup"),
    "collectives": MicroTable("collectives", ("nccl", "ours-ring"), base={"implementation": "nccl"}, ratio="over",
                              where={"shape": sizes((2, 4), "8 KiB", "32 MiB", "128 MiB", "1 GiB")}),
    "tp-comm": MicroTable("tp-comm", ("all_reduce, idle", "all_reduce, beside GEMMs"), across="op",
                          base={"op": "all_reduce, idle"}, ratio="over"),
    "tp-scaling": MicroTable("tp-scaling", ("ours-tp1", "ours-tp2", "ours-tp4"), base={"implementation": "ours-tp1"},
                             ratio="speedup"),
    "per-op": MicroTable("per-op", ("fwd ms", "bwd ms", "fwd+bwd ms"), across="metric", ratio="share",
                         base={"op": "whole block (fwd+bwd, timed as one)", "metric": "fwd+bwd ms"},
                         ratio_metrics=("fwd+bwd ms",)),
    "profile": MicroTable("profile", ("gemm", "elementwise/other", "attention", "communication", "optimizer",
                                      "device busy", "step wall"), across="op", base={"op": "step wall"},
                          ratio="share"),
}
PAGES = {ROOT / "README.md": ("headline",), ROOT / "docs" / "results.md": (*(t for t in TABLES if t != "headline"),
                                                                             "kernel-sets", "targets", "span",
                                                                             "simulated", "simulated-cuts",
                                                                             "simulated-before-after",
                                                                             *MICRO_TABLES),
         ROOT / "benchmarks" / "results" / "simulated" / "README.md": ("simulated-before-after", "simulated-cuts")}
BLOCK = "<!-- generated:{0} -->\n(.*?)<!-- end generated:{0} -->"


def block(name: str, rows: Mapping[int, Row], page: Path, micro: Sequence[Row] = ()) -> str:
    prefix = "" if page.parent == ROOT else "../"
    if name in MICRO_TABLES:
        return render_micro(MICRO_TABLES[name], micro, link_prefix=prefix)
    if name == "targets":
        return targets(rows)
    if name == "span":
        return span(rows)
    if name == "simulated":
        return simulated(rows)
    if name == "simulated-cuts":
        return simulated_cuts(rows)
    if name == "simulated-before-after":
        return simulated_before_after(rows)
    if name == "kernel-sets":
        return kernel_sets(rows, link_prefix=prefix)
    return render(TABLES[name], rows, link_prefix=prefix)


def generate(text: str, page: Path, rows: Mapping[int, Row], micro: Sequence[Row] = ()) -> str:
    for name in PAGES[page]:
        pattern = re.compile(BLOCK.format(re.escape(name)), re.S)
        if not pattern.search(text):
            raise SystemExit(f"{page.relative_to(ROOT)} has no block {name!r} (<!-- generated:{name} -->)")
        new = f"<!-- generated:{name} -->\n{block(name, rows, page, micro)}<!-- end generated:{name} -->"
        text = pattern.sub(lambda _, new=new: new, text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when a page's generated blocks are stale")
    p.add_argument("--store", type=Path, default=STORE)
    p.add_argument("--microbench", type=Path, default=MICROBENCH)
    args = p.parse_args(argv)
    rows = by_id(read_rows(args.store))
    micro = read_rows(args.microbench)
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = generate(text, page, rows, micro)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"stale generated tables in {', '.join(stale)}: run python -m tools.results_tables", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
