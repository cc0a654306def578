"""The training loop, shared by every mode: `train_step` (micro-steps + optimizer step), the non-finite guard's
reads (`gpt2.engines.guard`), `step_record` (the logged metrics), a recorder (JSONL/wandb + progress bar on the main
rank,
`NullRecorder` elsewhere), eval, and `build_summary`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from fused_kernels.attention import AttentionChoice
from gpt2.config.layout import RunLayout
from gpt2.config.schema import RunConfig
from gpt2.data.loader import DataBundle
from gpt2.engines.base import Engine
from gpt2.engines.guard import GuardReading, install_fault_injection
from gpt2.model.flops import flops_per_token, hardware_flops_per_token, model_params_for_flops
from gpt2.observe.metrics import (
    LapTimer,
    MemoryStats,
    PeakMemory,
    ThroughputMeter,
    TrainingCommMeter,
    allocated_gib,
    device_peak_tflops,
    host_cpu,
)
from gpt2.observe.profiling import StepProfiler
from gpt2.observe.run_logging import MetricsLogger, log
from gpt2.runtime.distributed import DistContext
from gpt2.train.checkpoint import Checkpointer
from gpt2.train.preemption import Preempted, PreemptionWatcher

# What train.py adds to the summary from the plan it made before the run (gpt2.planning.planner.compare_with_run,
# bound to that plan): called with the summary and the measured TP and DP payload per step by collective kind. The
# loop takes it as a function so that it never imports the planner.
SummaryComparison = Callable[[dict[str, Any], dict[str, float] | None, dict[str, float] | None], dict[str, Any]]


def _dp_mean(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.distributed and ctx.dims.dp_size > 1:
        values = values.clone()
        dist.all_reduce(values, group=ctx.dims.dp_group)
        values /= ctx.dims.dp_size
    return values


def _world_max(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def _memory_record(ctx: DistContext, memory: PeakMemory, *, after_step: bool) -> dict[str, float | None]:
    """Peak memory per device as of the last reading and, read right after a step, `mem/allocated_after_step_gib`:
    what each device holds then, the part of the peak a mode keeps for the whole run
    (gpt2.observe.metrics.allocated_gib;
    None where the platform cannot say, the same on every rank). Max over all ranks, in one collective."""
    mem = memory.peak
    held = allocated_gib(ctx.device) if after_step else None
    values = _world_max(torch.tensor([mem.peak_allocated_gib, mem.peak_reserved_gib, mem.alloc_retries,
                                      -1.0 if held is None else held], dtype=torch.float64, device=ctx.device),
                        ctx).tolist()
    record: dict[str, float | None] = {**MemoryStats(values[0], values[1], int(values[2])).as_dict()}
    if after_step:
        record["mem/allocated_after_step_gib"] = None if held is None else values[3]
    return record


def _device_name(ctx: DistContext) -> str:
    return torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"


class NullRecorder:
    """Metrics and progress on a rank that writes neither (every rank but the main one)."""

    run_dir: Path | None = None

    def log_step(self, step: int, record: dict[str, Any]) -> None:
        pass

    def show(self, record: dict[str, Any]) -> None:
        pass

    def advance(self) -> None:
        pass

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressRecorder(NullRecorder):
    """The main rank's metrics (JSONL + wandb through MetricsLogger) and its progress bar."""

    def __init__(self, logger: MetricsLogger, max_steps: int, start_step: int):
        self.logger = logger
        self.run_dir = logger.run_dir
        tqdm.monitor_interval = 0  # no daemon monitor thread: it could wake inside interpreter shutdown
        self.bar = tqdm(total=max_steps, initial=start_step, dynamic_ncols=True, unit="step")

    def log_step(self, step: int, record: dict[str, Any]) -> None:
        self.logger.log_step(step, record)

    def show(self, record: dict[str, Any]) -> None:
        mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
        self.bar.set_postfix_str(f"loss {record['loss']:.4f} tok/s {record['tokens_per_s']:,.0f} MFU {mfu} "
                                 f"mem {record['mem/peak_allocated_gib']:.2f}GiB")

    def advance(self) -> None:
        self.bar.update(1)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.logger.log_summary(summary)

    def close(self) -> None:
        self.bar.close()


def train_step(layout: RunLayout, ctx: DistContext, engine: Engine, data: DataBundle
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over grad_accum micro-batches: (loss sum, correct-token sum, pre-clip grad norm)."""
    grad_accum = layout.grad_accum
    loss_sum = torch.zeros((), device=ctx.device)
    correct_sum = torch.zeros((), device=ctx.device)
    for micro in range(grad_accum):
        x, y = data.train.next_batch()
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        loss, correct = engine.forward_backward(x, y, last_micro_step=micro == grad_accum - 1)
        loss_sum += loss.float()
        correct_sum += correct.float()
    return loss_sum, correct_sum, engine.optimizer_step()


def step_record(layout: RunLayout, ctx: DistContext, engine: Engine, meter: ThroughputMeter, memory: PeakMemory,
                step: int, loss_sum: torch.Tensor, correct_sum: torch.Tensor,
                grad_norm: torch.Tensor) -> dict[str, Any]:
    """The logged metrics of one step (collective: the loss and accuracy are averaged over the DP group)."""
    t, grad_accum = layout.cfg.train, layout.grad_accum
    loss_acc = _dp_mean(torch.stack([loss_sum / grad_accum,
                                     correct_sum / (grad_accum * t.batch_size * t.seq_len)]), ctx).tolist()
    return {"loss": loss_acc[0], "accuracy": loss_acc[1], "grad_norm": float(grad_norm),
            "lr": engine.lr, **meter.interval(),
            **_memory_record(ctx, memory, after_step=True),
            "tokens_seen": step * layout.tokens_per_step}


def _save_unless_skipped(checkpointer: Checkpointer, step: int, reading: GuardReading) -> tuple[Path | None, bool]:
    """Save after `step` if its update was applied; returns (the checkpoint, whether a save is still owed)."""
    if reading.streak:
        log.warning("checkpoint of step %d postponed: its update was skipped (non-finite loss or gradient norm); "
                    "the save waits for the next applied step", step)
        return None, True
    return checkpointer.save(step), False


def _preempted(step: int, preemption: PreemptionWatcher, checkpointer: Checkpointer | None, saved: Path | None,
               reading: GuardReading) -> Preempted:
    """Save this step unless just saved or skipped; the Preempted to raise (every rank)."""
    came_after = preemption.came_after
    if checkpointer is None:
        return Preempted(step, preemption.received, None, came_after=came_after)
    if saved is None:
        saved, _ = _save_unless_skipped(checkpointer, step, reading)
    return Preempted(step, preemption.received, str(saved) if saved else None,
                     "its update was skipped (non-finite): not saved", came_after)


def run_training(layout: RunLayout, ctx: DistContext, engine: Engine, data: DataBundle,
                 logger: MetricsLogger | None, start_step: int = 0,
                 checkpointer: Checkpointer | None = None,
                 preemption: PreemptionWatcher | None = None,
                 compare: SummaryComparison | None = None) -> dict[str, Any]:
    """Train from `start_step` to max_steps; returns the summary record (identical on every rank but for
    `--profile`'s figures, which only rank 0 has).

    After every optimizer step the non-finite guard counts it on the device (`gpt2.engines.guard`); the loop reads the
    guard where it reads numbers anyway (log steps, saves, a preemption), and every --max-bad-steps steps one step
    late (`gpt2.runtime.readback`: no wait for the step in flight), and raises
    NonFiniteError on every rank once the run must stop. A checkpoint is saved when `checkpointer.due(step)`, but
    only after an applied update: a save due at a skipped step is made after the next applied one. Then, before the
    last step, all ranks agree on `preemption.should_stop`: if any rank got a preemption signal, every rank saves
    this step (unless just saved, or skipped) and raises Preempted.
    """
    cfg, t = layout.cfg, layout.cfg.train
    peak = device_peak_tflops(ctx.device, cfg.log.peak_tflops)
    meter = ThroughputMeter(
        tokens_per_step=layout.tokens_per_step, flops_per_token=flops_per_token(cfg.model, t.seq_len),
        hw_flops_per_token=hardware_flops_per_token(cfg.model, t.seq_len, t.activation_checkpointing),
        n_devices=ctx.world_size, peak_tflops=peak, warmup_steps=start_step + t.untimed_steps)
    memory = PeakMemory(ctx.device)
    if ctx.simulated:
        log.warning("%sthe collectives move nothing and return stand-in values: this rank's memory, compute and "
                    "host path are the layout's, its throughput and losses are not (no parity verdict)",
                    simulated_label(ctx))
    log.info("tokens/step %d (dp %d x batch %d x accum %d x seq %d); FLOPs/token %.3e; peak %s TFLOP/s",
             layout.tokens_per_step, layout.dp_size, t.batch_size, layout.grad_accum, t.seq_len,
             meter.flops_per_token, peak)

    # the main rank logs and shows progress (train.py gives it the MetricsLogger); the other ranks record nothing
    recorder = ProgressRecorder(logger, t.max_steps, start_step) if logger is not None else NullRecorder()
    # the profiler counts the steps this process runs, as untimed_steps does: a resumed run profiles its own
    # steps W+2..W+4 after its start, the ones tokens/s leaves out
    profiler = StepProfiler(t.profile, recorder.run_dir, t.throughput_warmup_steps, ctx.device, engine.module)
    for warning in layout.warnings(start_step):
        log.warning("%s", warning)
    guard = engine.guard
    install_fault_injection(engine.module, layout.grad_accum, start_step, ctx.rank)
    last: dict[str, Any] = {}
    reading = GuardReading(0, 0, 0, 0)
    owed = False  # a save came due at a skipped step
    comm = TrainingCommMeter(engine)
    train_start = time.perf_counter()
    timer = LapTimer(ctx.device)
    for step in range(start_step + 1, t.max_steps + 1):
        comm.start_step()
        loss_sum, correct_sum, grad_norm = train_step(layout, ctx, engine, data)
        guard.record(step, loss_sum, grad_norm)
        comm.end_step()
        log_due = step % cfg.log.log_interval == 0 or step in (start_step + 1, t.max_steps)
        save_due = checkpointer is not None and (owed or checkpointer.due(step))
        evaluating = bool(t.eval_interval) and step % t.eval_interval == 0 and step != t.max_steps
        # synchronised where the timed window starts (the last untimed step) and ends, where a log reads its
        # interval, and before the work that `timer.restart()` leaves out (a save, an evaluation, the profile's
        # write); not at the profiled steps, which then run as unprofiled ones do
        meter.record(step, timer.lap(sync=step == meter.warmup_steps or log_due or save_due or evaluating))
        memory.observe()
        if profiler.step():
            timer.restart()

        late = guard.finish_check(ctx)  # the periodic check started after the step before, if any
        if log_due or save_due:  # these read numbers anyway; a save needs this step's verdict
            reading = guard.check(step, ctx)
        else:
            reading = reading if late is None else late
            if guard.check_due(step):
                guard.start_check(step, ctx)
        if log_due:
            last = step_record(layout, ctx, engine, meter, memory, step, loss_sum, correct_sum, grad_norm)
            last["skipped_steps"] = reading.skipped
            recorder.log_step(step, last)
            recorder.show(last)
            log.debug("step %d %s", step, last)
        guard.raise_if_tripped(reading, step)
        recorder.advance()
        saved = None
        if save_due:
            saved, owed = _save_unless_skipped(checkpointer, step, reading)
        if preemption and step < t.max_steps and preemption.should_stop(ctx, step):
            reading = guard.check(step, ctx)
            guard.raise_if_tripped(reading, step)
            recorder.close()
            profiler.stop()
            raise _preempted(step, preemption, checkpointer, saved, reading)

        if evaluating:
            _evaluate(cfg, engine, data, recorder, step)
        if save_due or evaluating:
            timer.restart()  # not the next step's time
    if owed:
        log.warning("no checkpoint of the last step %d: its update was skipped; the newest checkpoint is older",
                    t.max_steps)
    recorder.close()
    profiler.stop()
    train_time = time.perf_counter() - train_start

    val = _evaluate(cfg, engine, data, recorder, t.max_steps)
    memory.observe()  # the final evaluation's peak counts too
    summary = build_summary(layout, ctx, meter, memory, peak, start_step=start_step, train_time=train_time, last=last,
                            val=val, skipped_steps=reading.skipped,
                            attention=getattr(engine.module, "attention_choice", None),
                            whole_mlp_op=getattr(engine.module, "mlp_op", False), profile=profiler.summary_fields())
    if compare is not None:  # predicted next to measured memory and communication
        summary.update(compare(summary, comm.per_step("tp"), comm.per_step("dp")))
    recorder.log_summary(summary)
    mfu = summary["mfu"]
    tok_s = summary["tokens_per_s"]
    log.info("summary: %s%s %s | %s tok/s | MFU %s | peak mem %.2f GiB | final loss %.4f | val loss %s",
             simulated_label(ctx), t.mode, t.model, f"{tok_s:,.0f}" if tok_s else "n/a",
             f"{100 * mfu:.1f}%" if mfu else "n/a",
             summary["mem/peak_allocated_gib"], summary["final_loss"], summary.get("val_loss", "n/a"))
    return summary


def build_summary(layout: RunLayout, ctx: DistContext, meter: ThroughputMeter, memory: PeakMemory,
                  peak: float | None, *,
                  start_step: int, train_time: float, last: dict[str, Any], val: dict[str, float],
                  skipped_steps: int, attention: AttentionChoice | None = None, whole_mlp_op: bool = False,
                  profile: dict[str, float | None] | None = None) -> dict[str, Any]:
    """The run's summary record (collective: peak memory is the max over ranks). `attention`: what `--attn`
    resolved to at model build (`attn_backend`: the kernel that runs; `attn_choice`: with auto's timings).
    `whole_mlp_op`: the fused-kernel backend runs each MLP as one op (under bf16 autocast).
    `profile`: `--profile`'s per-step figures (`profile/device_busy_pct`, ...; rank 0's, the rank that profiles)."""
    cfg, t = layout.cfg, layout.cfg.train
    return {
        "mode": t.mode, "zero_engine": layout.zero_engine, "zero_stage": layout.zero_stage, "model": t.model,
        "n_params": model_params_for_flops(cfg.model),
        "world_size": layout.world_size, "tp_size": layout.tp_size, "dp_size": layout.dp_size,
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "batch_size_per_gpu": t.batch_size, "grad_accum": layout.grad_accum, "seq_len": t.seq_len,
        "tokens_per_step": layout.tokens_per_step, "precision": layout.precision,
        "fused_kernels": t.fused_kernels, "whole_mlp_op": whole_mlp_op, "attn": t.attn,
        "attn_backend": attention.backend if attention else None,
        "attn_choice": attention.describe() if attention else None, "compile": layout.compile_scope,
        # the launch code of torch.compile's graphs (--compile-wrapper as resolved), FSDP2's unit and the dtype its
        # blocks are gathered in (--fsdp2-gather as resolved)
        "compile_wrapper": layout.compile_wrapper,
        "fsdp2_unit_blocks": layout.fsdp2_unit_blocks if layout.fsdp2 else None,
        "fsdp2_params": layout.cfg.parallel.fsdp2_params if layout.fsdp2 else None,  # its own tensors or flat ones
        "zero3_fetch": layout.zero3_fetch,  # DeepSpeed ZeRO-3's gather: module, block or flat (None: no such hooks)
        "zero3_unit_blocks": layout.zero3_unit_blocks if layout.zero3_blocks else None,
        "fsdp2_gather": layout.fsdp2_gather,
        "fsdp2_forward_prefetch": layout.cfg.parallel.fsdp2_forward_prefetch if layout.fsdp2 else None,
        "activation_checkpointing": t.activation_checkpointing, "device": _device_name(ctx),
        "host_cpu": host_cpu(),
        "peak_tflops_per_gpu": peak, "flops_per_token": meter.flops_per_token,
        "steps": t.max_steps, "start_step": start_step,  # a resumed run trained steps start_step+1..steps
        "skipped_steps": skipped_steps,  # of those, updates skipped for a non-finite loss or gradient norm
        "train_time_s": train_time, **meter.summary(), **_memory_record(ctx, memory, after_step=False),
        "mem/allocated_after_step_gib": last.get("mem/allocated_after_step_gib"),  # the last logged step's
        "final_loss": last.get("loss"), "final_accuracy": last.get("accuracy"), **val,
        "torch_version": torch.__version__, "profiled": bool(profile), **(profile or {}),
        **({"simulated": True, "simulated_rank": ctx.rank} if ctx.simulated else {}),
    }


def simulated_label(ctx: DistContext) -> str:
    """The console's prefix for a simulated rank's lines (empty for a real run)."""
    return f"SIMULATED rank {ctx.rank} of {ctx.world_size}: " if ctx.simulated else ""


def _evaluate(cfg: RunConfig, engine: Engine, data: DataBundle, recorder: NullRecorder,
              step: int) -> dict[str, float]:
    if data.val is None:
        return {}
    loss, acc = engine.evaluate(data.val.iter_epoch(cfg.data.eval_batches))
    out = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0)), "val_accuracy": acc}
    recorder.log_step(step, out)
    log.info("eval step %d: val loss %.4f ppl %.2f acc %.4f", step, loss, out["val_perplexity"], acc)
    return out
