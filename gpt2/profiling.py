"""`--profile`: torch.profiler over 3 steps after the throughput warm-up, summarised by kernel category.

Writes, into the run folder (rank 0): `profile_kernels.txt` (top kernels by device time),
`profile_breakdown.json` (device time per category and per step), and `trace.json` (Chrome trace).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from gpt2.run_logging import log

ACTIVE_STEPS = 3
# first match wins; kernel names of cuBLAS/CUTLASS/cuDNN/flash/NCCL/Triton/PyTorch
CATEGORIES: list[tuple[str, re.Pattern]] = [
    ("communication", re.compile(r"nccl|allreduce|all_gather|reduce_scatter", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*mha", re.I)),
    ("gemm", re.compile(r"gemm|matmul|cutlass|xmma|nvjet|sm\d+_.*mma|cublas|aten::(addmm|mm|bmm|linear)$", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
]


def categorise(kernel_name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return category
    return "elementwise/other"


class StepProfiler:
    """Call `step()` after every optimizer step; profiles steps skip+2 .. skip+1+ACTIVE_STEPS (1 warm-up)."""

    def __init__(self, enabled: bool, run_dir: Path | None, skip_steps: int, device: torch.device):
        self.run_dir = run_dir
        self._prof = None
        if enabled and run_dir is not None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self._prof = profile(activities=activities,
                                 schedule=schedule(wait=skip_steps, warmup=1, active=ACTIVE_STEPS, repeat=1),
                                 on_trace_ready=self._write)
            self._prof.start()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None

    def _write(self, prof: profile) -> None:
        assert self.run_dir is not None
        events = prof.key_averages()
        # device-side kernels only: user annotations (ProfilerStep#, module ranges) also appear on the
        # device timeline, spanning the kernels inside them
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation
                   and not e.key.startswith("ProfilerStep")]
        on_device = bool(kernels)
        sort_key = "self_cuda_time_total" if on_device else "self_cpu_time_total"
        (self.run_dir / "profile_kernels.txt").write_text(events.table(sort_by=sort_key, row_limit=40))
        # kernels are counted once: CPU ops also carry their kernels' device time, so they are skipped
        counted = kernels if on_device else [e for e in events if not e.key.startswith("ProfilerStep")]
        totals: dict[str, float] = {}
        for e in counted:
            us = e.self_device_time_total if on_device else e.self_cpu_time_total
            totals[categorise(e.key)] = totals.get(categorise(e.key), 0.0) + us
        per_step_ms = {k: v / 1000 / ACTIVE_STEPS for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
        steps = [e for e in events if e.key.startswith("ProfilerStep")]
        wall_ms = sum(e.cpu_time_total for e in steps) / 1000 / ACTIVE_STEPS if steps else None
        breakdown = {"time_base": "device kernel time" if on_device else "CPU op time",
                     "steps": ACTIVE_STEPS, "ms_per_step": per_step_ms, "step_wall_ms": wall_ms,
                     "note": "kernel times on different streams overlap (communication with compute), so their "
                             "sum can exceed the wall time; wall minus the sum bounds device idle time from below"}
        (self.run_dir / "profile_breakdown.json").write_text(json.dumps(breakdown, indent=2))
        prof.export_chrome_trace(str(self.run_dir / "trace.json"))
        log.info("profile (%s, ms/step; wall %s ms): %s", breakdown["time_base"],
                 f"{wall_ms:.1f}" if wall_ms else "n/a", ", ".join(f"{k} {v:.1f}" for k, v in per_step_ms.items()))
