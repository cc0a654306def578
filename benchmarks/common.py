"""Shared helpers of the benchmarks: timing, the device/version tag every result row carries, CSV output."""

from __future__ import annotations

import csv
import datetime
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch


def device_tag(device: torch.device | str | None = None) -> dict[str, str]:
    """Where and with what a result was measured: device name, count, date and library versions."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        name, count = torch.cuda.get_device_name(device), torch.cuda.device_count()
    else:
        name, count = f"cpu {platform.processor() or platform.machine()}", 1
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "device": name,
        "device_count": str(count),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": triton_version,
    }


def tag_line(tag: dict[str, str]) -> str:
    """One line for plot titles and markdown headers."""
    return f"{tag['device']} x{tag['device_count']}, {tag['date']}, torch {tag['torch']}, CUDA {tag['cuda']}"


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 2, device: torch.device | None = None) -> list[float]:
    """Wall time of each of `iters` calls of fn in ms: CUDA events on a GPU, perf_counter on CPU."""
    on_gpu = device is not None and device.type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_ms(fn: Callable[[], object], iters: int, warmup: int = 2, device: torch.device | None = None) -> float:
    return statistics.median(time_ms(fn, iters, warmup, device))


def write_csv(path: str | Path, rows: Iterable[dict[str, object]], tag: dict[str, str] | None = None) -> Path:
    """Write rows (dicts; the union of their keys is the header), each extended by the tag columns."""
    rows = [{**row, **(tag or {})} for row in rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header: dict[str, None] = {}
    for row in rows:
        header.update(dict.fromkeys(row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(header))
        writer.writeheader()
        writer.writerows(rows)
    return path


def markdown_table(rows: list[dict[str, object]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
