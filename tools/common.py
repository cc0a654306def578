"""Shared helpers of the tools and the studies: the device/version tag every result row carries, CSV and Markdown
output, and launching train.py runs as subprocesses (a free port, a time limit, the error line of a failed run).
Studies (benchmarks/) import these; tools never import benchmarks/."""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.observe.metrics import host_cpu

ROOT = Path(__file__).resolve().parents[1]
# an exception's line, or a refusal in argparse's form (`train.py: error: ...`), whose reason a failed row shows
ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)|[\w.]+: error): (.+)$")
# torchrun's "Root Cause" block names the first rank that failed; a rank killed by a signal prints no error line
ROOT_CAUSE_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*: (.+?)\s*$")
NATIVE_CRASH_LINE = re.compile(r"terminate called|Fatal Python error")


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
        "host_cpu": host_cpu(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": triton_version,
    }


def tag_line(tag: dict[str, str]) -> str:
    """One line for plot titles and markdown headers."""
    return f"{tag['device']} x{tag['device_count']}, {tag['date']}, torch {tag['torch']}, CUDA {tag['cuda']}"


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


def torchrun(nproc: int, numa_binding: str | None = None) -> list[str]:
    """The torchrun command line for `nproc` local processes, up to the script. --standalone: the launcher binds its
    rendezvous store on a port of its own choosing and holds it, where a --master_port picked beforehand by
    free_port() could be taken by another process (a concurrent launch's listener) before torchrun binds it.
    `numa_binding`: torchrun's --numa-binding (each rank's CPU affinity to its GPU's NUMA node, socket, ...)."""
    binding = ["--numa-binding", numa_binding] if numa_binding else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", *binding, f"--nproc_per_node={nproc}"]


def free_port() -> int:
    """A TCP port free right now on this host, for a listener started at once (the forked TP test harness, the test
    Slurm cluster, the single-process host-cost repro). Another process can take it before it is bound: torchrun
    launches use torchrun() and spawned children a file store instead, which take no port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_run_name(out: Path, name: str) -> str:
    """NAME, or NAME-1, NAME-2, ... (train.py's suffix rule): the first with neither out/runs/<it> nor
    out/logs/<it>.log, so that as --run-name it is the run folder's exact name and a rerun never truncates a log."""
    candidate, n = name, 1
    while (out / "runs" / candidate).exists() or (out / "logs" / f"{candidate}.log").exists():
        candidate, n = f"{name}-{n}", n + 1
    return candidate


def _last_error_index(lines: list[str]) -> int | None:
    """Index of the last `SomethingError: message` line that is not the launcher's own (ChildFailedError)."""
    for i in range(len(lines) - 1, -1, -1):
        match = ERROR_LINE.search(lines[i])
        if match and match.group(1) != "ChildFailedError":
            return i
    return None


def last_error(log: str) -> str:
    """What ended a failed run, as one line: the signal that killed a rank (torchrun's root cause, with the last
    native crash message), else the last `SomethingError: message` line (launcher wrapper errors skipped), else the
    failed rank's exit code, else the last line."""
    lines = log.splitlines()
    root_cause = _launcher_root_cause(lines)
    if root_cause and root_cause.signal:
        return root_cause.text[:300]
    i = _last_error_index(lines)
    if i is not None:
        match = ERROR_LINE.search(lines[i])
        return f"{match.group(1)}: {match.group(2)}"[:300]
    if root_cause:
        return root_cause.text[:300]
    lines = [line.strip() for line in lines if line.strip()]
    return lines[-1][:300] if lines else "no output"


@dataclass(frozen=True)
class RootCause:
    text: str  # e.g. `rank 1: Signal 6 (SIGABRT) received by PID 7 (terminate called without an active exception)`
    signal: bool  # the rank was killed by a signal (no Python error line explains it)


def _launcher_root_cause(lines: list[str]) -> RootCause | None:
    """torchrun's "Root Cause" block as one line: the failed rank, then its signal and the last native crash message
    (`terminate called ...` preferred over faulthandler's `Fatal Python error: ...`), or its exit code."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Root Cause")]
    if not starts:
        return None
    fields = dict(m.groups() for line in lines[starts[-1]:] if (m := ROOT_CAUSE_FIELD.match(line)))
    if "rank" not in fields:
        return None
    rank = fields["rank"].split()[0]
    cause = fields.get("traceback", "")
    if not cause.startswith("Signal "):  # an exit code: torchrun's traceback field then only says how to enable it
        return RootCause(f"rank {rank}: exitcode {fields.get('exitcode', '?').split()[0]}", signal=False)
    crashes = [line.strip() for line in lines[:starts[-1]] if NATIVE_CRASH_LINE.search(line)]
    crash = next((c for c in reversed(crashes) if c.startswith("terminate called")), crashes[-1] if crashes else "")
    return RootCause(f"rank {rank}: {cause}" + (f" ({crash})" if crash else ""), signal=True)


def error_excerpt(log: str, n_lines: int) -> list[str]:
    """The `n_lines` lines of a failed run's output that end at its error line (`last_error`'s), so the worker's
    traceback shows rather than torchrun's summary after it; the last lines where no error line is found."""
    lines = log.splitlines()
    i = _last_error_index(lines)
    end = len(lines) if i is None else i + 1
    return lines[max(0, end - n_lines):end]


# process groups of launches still running: each runs in its own session, so a signal to the tool never reaches it
_RUNNING_GROUPS: set[int] = set()
_STOPPING = threading.Event()  # the tool was signalled: launch() starts nothing more
STOP_GRACE_S = 30.0  # a launch ended early gets this long after SIGTERM (train.py stops at its next step), then SIGKILL


def _processes() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc (one that ends while read is left out)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            yield int(stat.parent.name), state, int(ppid), int(pgrp)


def _live_groups() -> set[int]:
    """The process groups with a running process (zombies, waiting for their parent to reap them, do not count)."""
    return {pgrp for _pid, state, _ppid, pgrp in _processes() if state != "Z"}


def _tree_groups(leader: int) -> set[int]:
    """The process groups of `leader` and of every process descended from it, read from /proc while they run:
    torchrun starts each worker in a session of its own, which a signal to the launch's group does not reach."""
    children: dict[int, list[int]] = {}
    group_of: dict[int, int] = {}
    for pid, _state, ppid, pgrp in _processes():
        children.setdefault(ppid, []).append(pid)
        group_of[pid] = pgrp
    groups, todo = {leader}, [leader]
    while todo:
        pid = todo.pop()
        groups.add(group_of.get(pid, leader))
        todo += children.get(pid, [])
    return groups


def end_launches(leaders: list[int]) -> None:
    """End launches and everything they started: SIGTERM to every process group of their trees (train.py stops at
    its next step), SIGKILL to whatever runs after STOP_GRACE_S, then wait (a few seconds at most) until nothing
    does. Signalling the launch's own group only once left torchrun's workers behind: a rank stuck in a collective
    (it catches SIGTERM to save at a step boundary it never reached) outlived its torchrun and held its GPU's memory,
    and every later run of that 4-GPU call ran out of memory."""
    groups = set().union(*(_tree_groups(leader) for leader in leaders)) - {os.getpgrp()}  # never the tool's own
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        for group in groups & _live_groups():  # an ended group's id may be reused meanwhile
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        deadline = time.monotonic() + wait_s
        while groups & _live_groups() and time.monotonic() < deadline:
            time.sleep(0.1)


def stop_launches_on_signal(before_exit: Callable[[], None] = lambda: None) -> None:
    """From the tool's main thread: on SIGTERM or SIGINT (`timeout`, Slurm's time limit, Ctrl-C) start no more
    launches (a parity tool's queued rows), end every running launch's process group (SIGTERM, then SIGKILL after
    STOP_GRACE_S), call `before_exit` (a tool's last tables), then exit 128 + the signal. Without it a launch
    outlives its tool and keeps the GPU: a DeepCompile parity run, orphaned by `timeout`, trained on beside the next
    tool's timed runs."""
    def stop(signum: int, _frame: object) -> None:
        _STOPPING.set()
        end_launches(list(_RUNNING_GROUPS))
        try:
            before_exit()
        except Exception as err:  # the tool still exits: a table it cannot write is reported, not raised
            print(f"could not write the last tables: {err}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def launch(cmd: list[str], log_path: Path, timeout: float,
           env: dict[str, str] | None = None) -> tuple[int | None, float]:
    """Run cmd from the repository root in its own process group, output to log_path; (exit code or None on
    timeout, seconds). `env` replaces os.environ for the child. Once the tool is signalled it starts nothing (None, 0).
    """
    start = time.perf_counter()
    if _STOPPING.is_set():
        return None, 0.0
    with log_path.open("w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**(os.environ if env is None else env), "WANDB_SILENT": "true",
                                     "PYTHONUNBUFFERED": "1"})
        _RUNNING_GROUPS.add(proc.pid)
        if _STOPPING.is_set():  # the signal came between Popen and the line above: the handler missed this group
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_launches([proc.pid])  # torchrun and its workers
            proc.wait()
            rc = None
        finally:
            _RUNNING_GROUPS.discard(proc.pid)
    return rc, time.perf_counter() - start
