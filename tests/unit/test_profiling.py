"""`--profile`'s step summary (gpt2.observe.profiling): device busy share, launches, collective calls, hooks."""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

from gpt2.config.schema import PROFILED_STEPS
from gpt2.observe.profiling import (
    CUPTI_TEARDOWN_ENV,
    SUMMARY_FIELDS,
    StepProfiler,
    busy_us,
    count_module_hooks,
    summarise,
)


@pytest.fixture(autouse=True)
def _cupti_teardown_env_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profiler sets the variable for its process: each test starts without it and leaves the session as it was."""
    monkeypatch.setenv(CUPTI_TEARDOWN_ENV, "")  # records the session's value (or its absence) for teardown
    monkeypatch.delenv(CUPTI_TEARDOWN_ENV)


def test_busy_is_the_union_of_overlapping_intervals():
    # two streams overlapping on [5, 10), a gap [12, 20), a kernel inside another
    assert busy_us([(0, 10), (5, 12), (20, 30), (22, 25)]) == 22
    assert busy_us([]) == 0


def test_module_hooks_count_each_kind():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].register_forward_pre_hook(lambda *a: None)
    model[0].register_forward_hook(lambda *a: None)
    model[1].register_full_backward_pre_hook(lambda *a: None)
    model[1].register_full_backward_hook(lambda *a: None)
    assert count_module_hooks(model) == 4


def test_summary_counts_collective_calls_per_step(gloo_world):
    """A CPU profile of 2 steps with 3 all-reduces each: 3 c10d calls per step (gloo's own work records on its
    thread are not counted again); per step means per ProfilerStep range, and the step wall is theirs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(2):
            with record_function(f"ProfilerStep#{i}"):
                for _ in range(3):
                    dist.all_reduce(torch.ones(4))
                torch.ones(8) @ torch.ones(8)
    s = summarise(list(prof.events()), module_hooks=7)
    assert s["steps"] == 2
    assert s["collective_calls_per_step"] == 3
    assert s["kernels_per_step"] == 0 and s["device_busy_pct"] is None  # no device here
    assert s["step_wall_ms"] > 0 and s["module_hooks_per_forward_backward"] == 7
    assert 0 < s["host_op_ms_per_step"] < s["step_wall_ms"]
    assert s["time_base"] == "CPU op time"


def _event(id_: int, name: str, start: float, end: float, device: bool = False) -> FunctionEvent:
    return FunctionEvent(id_, name, thread=0, start_us=start, end_us=end, use_device="cuda",
                         device_type=DeviceType.CUDA if device else DeviceType.CPU)


def test_the_summary_counts_only_kernels_launched_in_the_window():
    """The device runs behind the host: the trace's first kernels belong to the step before the window (their
    launches fell before it, unrecorded) and must not be counted as the window's."""
    steps = [_event(1, "ProfilerStep#1", 0, 1000), _event(2, "ProfilerStep#2", 1000, 2000)]
    launches = [_event(10, "cudaLaunchKernel", 100, 110), _event(11, "cuLaunchKernel", 1100, 1110)]
    kernels = [_event(9, "adamw_kernel", 0, 300, device=True),  # the previous step's, still running
               _event(10, "adamw_kernel", 300, 700, device=True),
               _event(11, "sum_squares_kernel", 1200, 1500, device=True)]
    s = summarise(steps + launches + kernels, module_hooks=None)
    assert s["ms_per_step"] == {"optimizer": 0.35}  # the Triton AdamW's norm counts with its update
    assert s["kernels_per_step"] == 1 and s["kernels_launched_before_window"] == 1
    assert s["device_busy_ms_per_step"] == 0.5  # busy: whatever ran while the window was open
    unlinked = summarise(steps + kernels, module_hooks=None)  # no launch records at all: every kernel is kept
    assert unlinked["ms_per_step"]["optimizer"] == 0.5 and unlinked["kernels_launched_before_window"] == 0


def test_step_profiler_writes_the_breakdown(tmp_path):
    model = torch.nn.Linear(4, 4)
    model.register_forward_pre_hook(lambda *a: None)
    profiler = StepProfiler(True, tmp_path, skip_steps=1, device=torch.device("cpu"), module=model)
    assert profiler.summary_fields() == {}  # nothing profiled yet
    recording = weakref.ref(profiler._prof)
    for step in range(1, 2 + PROFILED_STEPS):
        model(torch.ones(2, 4)).sum().backward()
        profiler.step()
        # the window (steps 2-5 after 1 skipped) is written and released at its last step, not before
        assert (profiler.breakdown is None) == (step <= PROFILED_STEPS), step
    assert recording() is None  # released before the steps that tokens/s measures
    written = (tmp_path / "profile_breakdown.json").stat().st_mtime_ns
    profiler.step()
    profiler.stop()
    assert (tmp_path / "profile_breakdown.json").stat().st_mtime_ns == written  # nothing profiled or written again
    breakdown = json.loads((tmp_path / "profile_breakdown.json").read_text())
    assert breakdown["steps"] == 3 and breakdown["module_hooks_per_forward_backward"] == 1
    assert profiler.summary_fields() == {f"profile/{k}": breakdown[k] for k in SUMMARY_FIELDS}
    assert breakdown["step_wall_ms"] > 0
    for name in ("trace.json", "profile_kernels.txt", "profile_host.txt"):
        assert (tmp_path / name).exists(), name


def test_the_profiler_detaches_cupti_when_its_window_ends_unless_told_otherwise(tmp_path, monkeypatch):
    # left attached, CUPTI's launch callbacks slow every timed step after the profiled ones; Kineto reads the
    # variable when the trace ends, so it must be set once the profiler is made, before any step
    StepProfiler(False, tmp_path, skip_steps=1, device=torch.device("cpu"))
    assert CUPTI_TEARDOWN_ENV not in os.environ  # no --profile, no change
    profiler = StepProfiler(True, tmp_path, skip_steps=1, device=torch.device("cpu"))
    assert os.environ[CUPTI_TEARDOWN_ENV] == "1"
    profiler.stop()
    monkeypatch.setenv(CUPTI_TEARDOWN_ENV, "0")
    StepProfiler(True, tmp_path, skip_steps=1, device=torch.device("cpu")).stop()
    assert os.environ[CUPTI_TEARDOWN_ENV] == "0"
