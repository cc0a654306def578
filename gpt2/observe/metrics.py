"""Throughput accounting: FLOPs per token, device peak table, MFU/HFU, memory and tokens/s.

All numbers a run reports come from here, so the formulas live in one place.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

_log = logging.getLogger("gpt2")

# Dense bf16 tensor-core peak, TFLOP/s per GPU (no sparsity), from the vendors' datasheets, keyed by
# (product, variant). torch.cuda.get_device_name() gives e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
# "NVIDIA A100-SXM4-80GB", "NVIDIA L40S": `device_product` splits it into words (at spaces and dashes) and the
# product is the first word after "NVIDIA", compared whole ("L40" is not "L4", "GH200" is not "H200"). The
# variant is "PCIe" or "NVL" when one of the words says so, else None (SXM / the only form).
PEAK_BF16_TFLOPS: dict[tuple[str, str | None], float] = {
    ("A100", None): 312.0, ("A100", "PCIe"): 312.0,
    ("A800", None): 312.0, ("A800", "PCIe"): 312.0,
    ("H100", None): 989.0,  # SXM5 (HBM3)
    ("H100", "PCIe"): 756.0,
    ("H100", "NVL"): 835.0,
    ("H800", None): 989.0, ("H800", "PCIe"): 756.0,
    ("H200", None): 989.0,  # SXM
    ("H200", "NVL"): 835.0,
    ("GH200", None): 989.0,
    ("L40S", None): 362.0,
    ("L40", None): 181.0,  # 362 is L40's figure with sparsity
    ("L4", None): 121.0,
}


def device_product(name: str) -> tuple[str, str | None]:
    """("H100", "PCIe") from "NVIDIA H100 PCIe"; ("A100", None) from "NVIDIA A100-SXM4-80GB"."""
    words = [w for w in re.split(r"[\s\-]+", name.strip()) if w]
    if words and words[0].upper() == "NVIDIA":
        words = words[1:]
    if not words:
        return "", None
    upper = {w.upper() for w in words[1:]}
    variant = "PCIe" if "PCIE" in upper else "NVL" if "NVL" in upper else None
    return words[0].upper(), variant


def peak_tflops_for_name(name: str) -> float | None:
    """The table's dense bf16 peak for a CUDA device name; None if the product/variant is not in the table."""
    return PEAK_BF16_TFLOPS.get(device_product(name))


def host_cpu() -> str:
    """The host CPU's model and the cores this process may use. Host-bound steps (ZeRO at small batches, eager
    custom ops) run at its speed, so two machines with the same GPU can differ widely (docs/decisions.md)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:  # no /proc (macOS): platform's name
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def device_peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Peak dense bf16 TFLOP/s of one device; `override` wins. Unknown devices warn loudly, return None."""
    if override is not None:
        return override
    if device.type != "cuda":
        _log.warning("no peak FLOP/s is known for device type %r: MFU is not reported. "
                     "Pass --peak-tflops to set one.", device.type)
        return None
    name = torch.cuda.get_device_name(device)
    if (tflops := peak_tflops_for_name(name)) is not None:
        return tflops
    _log.warning("!!! unknown GPU %r: MFU is not reported. Pass --peak-tflops <dense bf16 TFLOP/s>. !!!", name)
    return None


@dataclass
class MemoryStats:
    peak_allocated_gib: float
    peak_reserved_gib: float
    alloc_retries: int

    def as_dict(self) -> dict[str, float]:
        return {"mem/peak_allocated_gib": self.peak_allocated_gib,
                "mem/peak_reserved_gib": self.peak_reserved_gib,
                "mem/alloc_retries": self.alloc_retries}


def memory_stats(device: torch.device) -> MemoryStats:
    """Peak memory since start. CUDA: allocator peaks and retries. CPU: process peak RSS for both."""
    gib = 1024**3
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return MemoryStats(torch.cuda.max_memory_allocated(device) / gib,
                           torch.cuda.max_memory_reserved(device) / gib,
                           int(stats.get("num_alloc_retries", 0)))
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    rss = rss_kib if sys.platform == "darwin" else rss_kib * 1024
    return MemoryStats(rss / gib, rss / gib, 0)


def allocated_gib(device: torch.device) -> float | None:
    """Memory held now. CUDA: the allocator's bytes in live tensors; read between steps, that is what a run keeps
    across steps (weights, optimizer state, gradient buffers an engine keeps), so peak minus it is the step's
    transient memory (activations, gathered weights, buckets). CPU: the process's resident set (Linux; else None,
    decided by the platform alone, so every rank of a run agrees)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 1024**3
    if not sys.platform.startswith("linux"):
        return None
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 1024**3


class PeakMemory:
    """Peak memory since this process made it (a resumed run: since it resumed), as the running max of readings taken
    after every training step and at the run's end (after the final evaluation).

    Not the allocator's peak counter alone: a library may reset it mid-run. DeepSpeed's DeepCompile profiler calls
    `torch.cuda.reset_peak_memory_stats()` per graph node while it profiles (steps 1 and 6) and again when the eval
    graph compiles, so at the end of a run the counter held only the evaluation's peak (19.1 GiB for a batch-32 run
    whose training steps peaked at 71.5). A reset inside a step still hides that step's peak before the reset."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = MemoryStats(0.0, 0.0, 0)  # as of the last observe()

    def observe(self) -> None:
        now = memory_stats(self.device)
        self.peak = MemoryStats(max(self.peak.peak_allocated_gib, now.peak_allocated_gib),
                                max(self.peak.peak_reserved_gib, now.peak_reserved_gib),
                                max(self.peak.alloc_retries, now.alloc_retries))


class ThroughputMeter:
    """Tokens/s, MFU and HFU over the steps after `warmup_steps` (compilation, allocator warm-up).

    Tokens per step are counted per data-parallel replica: dp_size x micro_batch x grad_accum x seq_len
    (ranks of one tensor-parallel group process the same tokens). MFU = achieved model FLOP/s /
    (n_gpus x peak), with n_gpus the whole world (all TP and DP ranks).
    """

    def __init__(self, *, tokens_per_step: int, flops_per_token: float, hw_flops_per_token: float,
                 n_devices: int, peak_tflops: float | None, warmup_steps: int):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.hw_flops_per_token = hw_flops_per_token
        self.n_devices = n_devices
        self.peak_tflops = peak_tflops
        self.warmup_steps = warmup_steps
        self.measured_steps = 0
        self.measured_time = 0.0
        self._interval_steps = 0  # since the last `interval()`
        self._interval_time = 0.0

    def record(self, step: int, step_time: float) -> None:
        """Record one optimizer step (1-based `step`) that took `step_time` seconds (a `LapTimer` lap)."""
        self._interval_steps += 1
        self._interval_time += step_time
        if step > self.warmup_steps:
            self.measured_steps += 1
            self.measured_time += step_time

    def _rates(self, seconds_per_step: float) -> dict[str, float | None]:
        tok_s = self.tokens_per_step / seconds_per_step
        out: dict[str, float | None] = {
            "tokens_per_s": tok_s,
            "tokens_per_s_per_gpu": tok_s / self.n_devices,
            "mfu": None, "hfu": None,
        }
        if self.peak_tflops:
            peak = self.n_devices * self.peak_tflops * 1e12
            out["mfu"] = tok_s * self.flops_per_token / peak
            out["hfu"] = tok_s * self.hw_flops_per_token / peak
        return out

    def interval(self) -> dict[str, float | None]:
        """Mean step time and rates over the steps recorded since the last call (a log interval, which ends at a
        synchronised lap: its laps add up exactly, a single unsynchronised one need not)."""
        per_step = self._interval_time / max(self._interval_steps, 1)
        self._interval_steps, self._interval_time = 0, 0.0
        return {"step_time_s": per_step, **self._rates(max(per_step, 1e-12))}

    def summary(self) -> dict[str, float | None]:
        """Rates averaged over all measured (post-warm-up) steps; None-valued if none were measured."""
        if self.measured_steps == 0:
            return {"tokens_per_s": None, "tokens_per_s_per_gpu": None, "mfu": None, "hfu": None,
                    "step_time_s": None, "measured_steps": 0}
        per_step = self.measured_time / self.measured_steps
        return {**self._rates(per_step), "step_time_s": per_step, "measured_steps": self.measured_steps}


class LapTimer:
    """Wall time from one step's end to the next's: what each step costs the run, the loop's own work included.

    The device is synchronised only where `lap(sync=True)` asks (the loop: the last warm-up step, log, save and
    evaluation steps, the last step). Between those, a host-bound step queues its kernels while the device still
    runs the step before, as in a run nobody times; a lap taken without synchronising ends when the host is done,
    so single laps are rough, but the laps between two synchronised ones add up to the exact wall time between
    them. A synchronisation every step would idle the device while the host starts the next step, slowing a
    host-bound step (docs/decisions.md). `restart()` leaves out what ran since the last lap (evaluation, a
    checkpoint save, --profile's write)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.restart()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def restart(self) -> None:
        """Time the next lap from now, after the device has finished what is queued."""
        self._sync()
        self._last = time.perf_counter()

    def lap(self, sync: bool) -> float:
        """Seconds since the previous lap (or restart), after synchronising the device if `sync`."""
        if sync:
            self._sync()
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed


class TrainingCommMeter:
    """Measured payload per optimizer step, by group and collective kind, from what the engine exposes:
    `comm_stats` (a parallel.comm.CommStats: our TP collectives; engines without TP have none) and
    `zero_comm_log` (DeepSpeed's comms logger under --comm-log: ZeRO's collectives, see ZeroCommLog).

    Call `start_step()` before a step's first micro-batch and `end_step()` after its optimizer step: only
    what runs in between is counted, so evaluation forwards (--eval-interval, the final one) are left out.
    Every micro-batch of gradient accumulation is part of its step. DP bytes leave out the run's first step
    (DeepSpeed ZeRO-3 records its parameter trace there and gathers more): they need two steps or more.
    """

    def __init__(self, engine: object):
        self.tp = getattr(engine, "comm_stats", None)
        self.dp = getattr(engine, "zero_comm_log", None)
        self.total: dict[str, Counter] = {"tp": Counter(), "dp": Counter()}
        self.steps = 0

    def start_step(self) -> None:
        for source in (self.tp, self.dp):
            if source is not None:
                source.reset()

    def end_step(self) -> None:
        if self.tp is not None:
            for (op, _phase), n in self.tp.bytes.items():
                self.total["tp"][op] += n
        if self.dp is not None and self.steps > 0:  # ZeRO-3's first step records its trace: not steady state
            self.total["dp"].update(self.dp.bytes_by_collective())
        self.steps += 1

    def per_step(self, group: str) -> dict[str, float] | None:
        """Bytes per step of `group` ("tp" or "dp") by collective kind, averaged over the counted steps;
        None if the engine does not measure that group."""
        source, steps = (self.tp, self.steps) if group == "tp" else (self.dp, self.steps - 1)
        if source is None or steps <= 0:
            return None
        return {op: n / steps for op, n in sorted(self.total[group].items())}
