"""`--profile`: torch.profiler over 3 steps after the throughput warm-up, summarised by kernel category.

The profiled steps (and the profiler's own warm-up step) run slower than unprofiled ones, so tokens/s and MFU count
only the steps after them (`PROFILED_STEPS`): one run gives both its throughput and its profile.

Writes, into the run folder (rank 0): `profile_kernels.txt` (top kernels by device time), `profile_host.txt`
(top ops by their own host time: where a host-bound step goes), `profile_breakdown.json` (device time per
category and per step; how busy the device was; host time in ops; kernel launches, collective calls and module
hooks per step: the counts that say whether a step is host-bound and why), and `trace.json` (Chrome trace).
"""

from __future__ import annotations

import gc
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, schedule

from gpt2.config.schema import PROFILED_STEPS, ConfigError, TrainConfig
from gpt2.observe.run_logging import log

ACTIVE_STEPS = PROFILED_STEPS - 1  # after the schedule's warm-up step
# the breakdown's per-step figures that go into the run's summary.json, as profile/<name>
SUMMARY_FIELDS = ("step_wall_ms", "device_busy_pct", "host_op_ms_per_step", "kernels_per_step",
                  "collective_calls_per_step", "module_hooks_per_forward_backward")
DEVICE_TIME = "device kernel time"
# first match wins; kernel names of cuBLAS/CUTLASS/cuDNN/flash/NCCL/Triton/PyTorch
CATEGORIES: list[tuple[str, re.Pattern]] = [
    ("communication", re.compile(r"nccl|allreduce|all_gather|reduce_scatter", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*mha", re.I)),
    ("gemm", re.compile(r"gemm|matmul|cutlass|xmma|nvjet|sm\d+_.*mma|cublas|aten::(addmm|mm|bmm|linear)$", re.I)),
    # the Triton AdamW's norm (sum_squares_kernel) with the update, as torch's foreach norm is
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|sum_squares", re.I)),
]
# the CUDA runtime and driver calls that launch device work (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync, ...):
# a kernel carries its launch's correlation id
LAUNCH_CALL = re.compile(r"^cu(da)?[A-Z]")
# host-side collective calls: the c10d ops the process calls (the backend's own `nccl:`/`gloo:` work records on
# its threads are not counted again; NCCL kernels are the device side's communication category)
COLLECTIVE_CALL_PREFIX = "c10d::"
# host events that are not host work: waiting for the device (the step timer's and .item()'s synchronisations)
DEVICE_WAIT = re.compile(r"Synchronize", re.I)
# Kineto detaches CUPTI when a trace ends only if TEARDOWN_CUPTI=1 (pytorch/pytorch#144455); left attached, its
# callbacks stay on every kernel launch, and the timed steps after the profiled ones run slower where the host
# bounds the step. torch itself sets it to 0 only for CUDA graphs on CUDA < 12.6, which no run here captures.
CUPTI_TEARDOWN_ENV = "TEARDOWN_CUPTI"


def check_profile_window(t: TrainConfig, start_step: int) -> None:
    """--profile writes its profile after the run's step W + PROFILED_STEPS (W: --throughput-warmup-steps, counted
    from this run's first step): a run that ends before would write none."""
    steps, needed = t.max_steps - start_step, t.untimed_steps
    if t.profile and steps < needed:
        resumed = f" (resumed at step {start_step})" if start_step else ""
        raise ConfigError(f"--profile records steps {t.throughput_warmup_steps + 2}-{needed} of a run (after "
                          f"--throughput-warmup-steps {t.throughput_warmup_steps} and one profiler warm-up step), but "
                          f"this run trains {steps}{resumed}: raise --max-steps to {start_step + needed}, lower "
                          "--throughput-warmup-steps, or drop --profile")


def categorise(kernel_name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return category
    return "elementwise/other"


class StepProfiler:
    """Call `step()` after every optimizer step; profiles steps skip+2 .. skip+1+ACTIVE_STEPS (1 warm-up), counted
    from the first step after it is made (a resumed run's first step is 1 here)."""

    def __init__(self, enabled: bool, run_dir: Path | None, skip_steps: int, device: torch.device,
                 module: torch.nn.Module | None = None):
        self.run_dir = run_dir
        self.module = module
        self.breakdown: dict | None = None
        self._prof = None
        if enabled and run_dir is not None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            os.environ.setdefault(CUPTI_TEARDOWN_ENV, "1")  # a user's own setting stands
            self._prof = profile(activities=activities,
                                 schedule=schedule(wait=skip_steps, warmup=1, active=ACTIVE_STEPS, repeat=1),
                                 on_trace_ready=self._write)
            self._prof.start()

    def step(self) -> bool:
        """Advance the schedule; True at the step whose end wrote and dropped the profile (seconds of host work
        that the loop's timer leaves out)."""
        if self._prof is None:
            return False
        self._prof.step()
        if self.breakdown is None:
            return False
        self.stop()  # the window has ended and is written: let the steps after it run free
        return True

    def stop(self) -> None:
        """End profiling and drop the profile. Its events are hundreds of thousands of Python objects: kept alive,
        they would be scanned by every full garbage collection in the steps that tokens/s measures (host-bound
        runs ran slower after a retained profile: docs/decisions.md)."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
            gc.collect()

    def _write(self, prof: profile) -> None:
        assert self.run_dir is not None
        events = prof.key_averages()
        hooks = count_module_hooks(self.module) if self.module is not None else None
        self.breakdown = breakdown = summarise(list(prof.events()), hooks)
        sort_key = "self_cuda_time_total" if breakdown["time_base"] == DEVICE_TIME else "self_cpu_time_total"
        (self.run_dir / "profile_kernels.txt").write_text(events.table(sort_by=sort_key, row_limit=40))
        (self.run_dir / "profile_host.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=40))
        (self.run_dir / "profile_breakdown.json").write_text(json.dumps(breakdown, indent=2))
        prof.export_chrome_trace(str(self.run_dir / "trace.json"))
        wall, busy = breakdown["step_wall_ms"], breakdown["device_busy_pct"]
        log.info("profile (%s, ms/step; wall %s ms; device busy %s; %s kernels, %s collective calls per step): %s",
                 breakdown["time_base"], f"{wall:.1f}" if wall else "n/a", f"{busy}%" if busy is not None else "n/a",
                 breakdown["kernels_per_step"], breakdown["collective_calls_per_step"],
                 ", ".join(f"{k} {v:.1f}" for k, v in breakdown["ms_per_step"].items()))

    def summary_fields(self) -> dict[str, Any]:
        """The breakdown's per-step figures for the run's summary.json (none before the profile is written)."""
        if self.breakdown is None:
            return {}
        return {f"profile/{k}": self.breakdown[k] for k in SUMMARY_FIELDS}


def is_kernel(e: FunctionEvent) -> bool:
    """A device-side kernel: user annotations (ProfilerStep#, module ranges) also appear on the device timeline,
    spanning the kernels inside them."""
    return e.device_type == DeviceType.CUDA and not e.is_user_annotation and not e.key.startswith("ProfilerStep")


def launched_in_window(events: list[FunctionEvent], kernels: list[FunctionEvent]) -> list[FunctionEvent]:
    """The kernels whose launch the window recorded. The device runs behind the host, so the trace also holds the
    tail of the step before the window, launched before it began: counted per step, those would add part of a
    step. Where no launch matches any kernel (a profiler that records none), every kernel is kept."""
    launches = {e.id for e in events if e.device_type == DeviceType.CPU and LAUNCH_CALL.match(e.key)}
    launched = [k for k in kernels if k.id in launches]
    return launched if launched or not kernels else kernels


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: device time with at least one kernel running (kernels on
    different streams overlap, so their summed durations overstate it)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def count_module_hooks(module: torch.nn.Module) -> int:
    """Forward/backward (pre-)hooks registered on the modules of the tree themselves (not global hooks, nor the
    autograd functions ZeRO-3 also puts on module outputs for its backward fetches): each fires once per module
    call, so this counts Python hook calls per forward + backward."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_pre_hooks)
               + len(m._backward_hooks) for m in module.modules())


def summarise(events: list[FunctionEvent], module_hooks: int | None) -> dict:
    """The profile_breakdown.json record of the profiled steps (the events of `prof.events()`), per step: as many
    steps as ProfilerStep ranges, fewer than ACTIVE_STEPS where the run ended inside the window."""
    step_events = [e for e in events if e.key.startswith("ProfilerStep") and e.device_type == DeviceType.CPU]
    steps = max(len(step_events), 1)
    recorded = [e for e in events if is_kernel(e)]
    kernels = launched_in_window(events, recorded)
    on_device = bool(kernels)
    # kernels are counted once: CPU ops also carry their kernels' device time, so they are skipped
    counted = kernels if on_device else [e for e in events if not e.key.startswith("ProfilerStep")]
    totals: dict[str, float] = {}
    for e in counted:
        us = e.self_device_time_total if on_device else e.self_cpu_time_total
        totals[categorise(e.key)] = totals.get(categorise(e.key), 0.0) + us
    per_step_ms = {k: v / 1000 / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    wall_ms = sum(e.time_range.elapsed_us() for e in step_events) / 1000 / steps if step_events else None
    # busy: every kernel the device ran while the window was open, the previous step's tail included
    busy_ms = busy_us([(e.time_range.start, e.time_range.end) for e in recorded]) / 1000 / steps
    collectives = [e for e in events if e.device_type == DeviceType.CPU and e.key.startswith(COLLECTIVE_CALL_PREFIX)]
    host_ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_user_annotation
                and not e.key.startswith("ProfilerStep") and not DEVICE_WAIT.search(e.key)]
    return {"time_base": DEVICE_TIME if on_device else "CPU op time",
            "steps": steps, "ms_per_step": per_step_ms, "step_wall_ms": wall_ms,
            "device_busy_ms_per_step": round(busy_ms, 2) if on_device else None,
            "device_busy_pct": round(100 * busy_ms / wall_ms, 1) if on_device and wall_ms else None,
            "host_op_ms_per_step": round(sum(e.self_cpu_time_total for e in host_ops) / 1000 / steps, 2),
            "kernels_per_step": round(len(kernels) / steps, 1),
            "kernels_launched_before_window": len(recorded) - len(kernels),
            "collective_calls_per_step": round(len(collectives) / steps, 1),
            "module_hooks_per_forward_backward": module_hooks,
            "note": "ms_per_step sums the durations of the kernels launched in the profiled steps, per category "
                    "(kernels_launched_before_window: the previous step's tail, not counted there); kernels on "
                    "different streams overlap (communication with compute), so the sum can exceed the wall time. "
                    "device_busy is the union of all kernel intervals recorded: wall minus busy is time the device "
                    "waited for the host. host_op_ms is the host time inside PyTorch ops and runtime calls (all "
                    "threads; waits for the device and Python between ops not counted)"}
