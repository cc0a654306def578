"""What a study measures and how it prints: wall time of a callable (CUDA events on a GPU), the CUDA memory one call
allocates, and a titled Markdown table written next to its CSV. Shared by the studies and repros under benchmarks/
(the output helpers they share with the tools are tools.common's)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tools.common import markdown_table, write_csv


def cuda_event_ms(fn: Callable[[], object]) -> float:
    """ms between CUDA events recorded on the current stream before and after one call of fn (waits for the second)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 2, device: torch.device | None = None) -> list[float]:
    """Wall time of each of `iters` calls of fn in ms: CUDA events on a GPU, perf_counter on CPU."""
    on_gpu = device is not None and device.type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if on_gpu:
            times.append(cuda_event_ms(fn))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_ms(fn: Callable[[], object], iters: int, warmup: int = 2, device: torch.device | None = None) -> float:
    return statistics.median(time_ms(fn, iters, warmup, device))


def peak_alloc_mib(fn: Callable[[], object]) -> float:
    """MiB that one call of fn allocates on the current CUDA device at its peak, above what was allocated before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def report_table(title: str, command: str, rows: list[dict[str, object]], columns: list[str], *, out: Path | None,
                 stem: str, tag: dict[str, str]) -> None:
    """Print a Markdown table under its title and the command that made it; with `out`, also write it to
    <out>/<stem>.md and the rows (with the `tag` columns) to <out>/<stem>.csv."""
    report = f"# {title}\n\n`{command}`\n\n{markdown_table(rows, columns)}\n"
    print("\n" + report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.md").write_text(report)
        write_csv(out / f"{stem}.csv", rows, tag)
