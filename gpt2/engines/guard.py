"""The non-finite guard: an update whose loss or gradient norm is not finite is never applied and never
checkpointed, and --max-bad-steps of them in a row stop the run (EXIT_NONFINITE), with no host synchronisation
per step.

One rule decides every skip, in every engine and on every rank: **a step whose global gradient norm is not finite
updates nothing** (parameters, optimizer moments and step counts stay as they were). TorchEngine hands the flag to
the fused AdamW as GradScaler's `found_inf` (read on the device); DeepSpeed ZeRO-1/2/3 skips such a step itself
(its overflow check; `gpt2.config.deepspeed_file` keeps it on). A non-finite loss is folded into that rule by `gate`:
before each backward the loss is multiplied by 1 (bit-identical), or by NaN when it is not finite, so every gradient and
therefore the global norm turn NaN; the data-parallel gradient reduction carries that to every rank, so all ranks
skip the same steps without an extra collective.

What a skipped step still does: it consumes its batch, its step number and its point on the LR schedule (the next
step trains at the LR of its own step number, in every engine; fp16 loss-scale overflows are skipped the same way).

`record` counts on the device the run of consecutive bad steps: a non-finite loss, or a non-finite gradient norm
except in fp16, where a finite loss with overflowing gradients is the loss scaler's business (it lowers the scale; the
step is skipped, not counted). Once the run reaches --max-bad-steps the guard latches: every later update is skipped
too (the gate poisons every loss), so the weights stay those from before the bad steps. `check` copies the counters
to the host only where the loop reads numbers anyway (logging steps, checkpoint saves, every --max-bad-steps steps,
the last step, a preemption); `raise_if_tripped` then raises NonFiniteError on every rank once latched. The loop
saves a checkpoint only after a step whose update was applied: a save that comes due at a skipped step waits for the
next applied one, so `latest`, and the newest checkpoint that --keep-last keeps, never end inside a run of bad steps.

Fault injection (tests only): `GPT2_TEST_NONFINITE=KIND@STEPS[/RANK],...` (e.g. `loss@3,grad@6-8/1`) makes the
training loss of those steps non-finite (`loss`: a NaN value, finite gradients) or its gradients infinite (`grad`:
a finite value), on every rank or only on RANK. `install_fault_injection` reads it; tests/integration/test_nonfinite.py
uses it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gpt2.observe.run_logging import log
from gpt2.runtime.distributed import DistContext
from gpt2.runtime.readback import LateRead

if TYPE_CHECKING:
    from gpt2.config.layout import RunLayout

EXIT_NONFINITE = 65  # sysexits' EX_DATAERR: the numbers went bad; distinct from 2 (configuration) and 75 (preempted)
FAULT_ENV = "GPT2_TEST_NONFINITE"
_FAULT = re.compile(r"^(loss|grad)@(\d+)(?:-(\d+))?(?:/(\d+))?$")


class NonFiniteError(Exception):
    """Raised on every rank at the same step once --max-bad-steps consecutive steps were non-finite."""


@dataclass(frozen=True)
class GuardReading:
    """The guard's counters on the host (max over ranks)."""

    streak: int  # consecutive bad steps ending at the step read; 0: that step's update was applied
    skipped: int  # updates skipped in this run so far (bad steps, fp16 loss-scale overflows, latched steps)
    tripped_at: int  # the step at which the streak reached --max-bad-steps; 0: never
    last_skipped: int  # the latest skipped step; 0: none


class NonFiniteGuard:
    """Device-side counters of non-finite steps; `gate` and `record` never synchronise, `check` does (collective)."""

    def __init__(self, max_bad_steps: int, device: torch.device, counts_grad_overflow: bool, advice: str):
        self.max_bad_steps = max_bad_steps
        self.counts_grad_overflow = counts_grad_overflow
        self.advice = advice
        self._state = torch.zeros(4, dtype=torch.int64, device=device)  # GuardReading's fields, in order
        self._tripped = torch.zeros((), dtype=torch.bool, device=device)
        self._reported = 0  # `skipped` at the last check: warn about new skips once
        self._late: tuple[int, LateRead] | None = None  # a periodic check started after that step, not yet read

    @classmethod
    def for_run(cls, layout: RunLayout, device: torch.device) -> NonFiniteGuard:
        t = layout.cfg.train
        # only what this run can change: a CPU run is fp32 whatever --precision says; without --save-dir, no resume
        precision = (f", or train in another --precision (now {layout.precision}"
                     + ("; bf16 has fp32's range" if layout.precision == "fp16" else "") + ")"
                     if layout.device_type == "cuda" else "")
        then = ("then resume from the newest checkpoint (--resume auto)" if layout.cfg.checkpoint.save_dir
                else "then rerun (no --save-dir: nothing was saved)")
        advice = (f"lower --lr (now {t.lr:g}) or raise --warmup-steps (now {t.warmup_steps}), check the training "
                  f"data of those steps{precision}; {then}")
        return cls(t.max_bad_steps, device, counts_grad_overflow=layout.precision != "fp16", advice=advice)

    def gate(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` x 1, or x NaN when it is not finite or the guard has latched: the gradients then turn NaN, and
        the engine skips the step for its non-finite gradient norm (a NaN times a zero gradient is still NaN)."""
        ok = torch.isfinite(loss.detach()) & ~self._tripped
        return loss * torch.where(ok, 1.0, float("nan"))

    def record(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Count `step` (device ops only): its loss sum over micro-steps and its global pre-clip gradient norm."""
        skipped = ~torch.isfinite(grad_norm)  # what the engine did: the same on every rank
        bad = ~torch.isfinite(loss_sum)
        if self.counts_grad_overflow:
            bad = bad | skipped
        streak, total, tripped_at, last = self._state.unbind()
        streak = torch.where(bad, streak + 1, 0)
        tripped_at = torch.where((tripped_at == 0) & (streak >= self.max_bad_steps), step, tripped_at)
        self._state = torch.stack([streak, total + skipped, tripped_at, torch.where(skipped, step, last)])
        self._tripped = tripped_at > 0

    def _reduced(self, ctx: DistContext) -> torch.Tensor:
        state = self._state.clone()
        if ctx.distributed:  # fp16 counts each rank's own loss: the ranks may differ, the decision may not
            dist.all_reduce(state, op=dist.ReduceOp.MAX)
        return state

    def read(self, ctx: DistContext) -> GuardReading:
        """The counters on the host, max over all ranks (collective; waits for the device)."""
        return GuardReading(*self._reduced(ctx).tolist())

    def start_check(self, step: int, ctx: DistContext) -> None:
        """`check` without waiting for the device (collective): the counters as of `step`, reduced over the ranks,
        on their way to the host; `finish_check` at the next step reads them (the periodic check: a wait every
        --max-bad-steps steps would stall a host-bound step, gpt2.runtime.readback)."""
        self._late = step, LateRead(self._reduced(ctx))

    def finish_check(self, ctx: DistContext) -> GuardReading | None:
        """The reading `start_check` started (warned about as `check` does), or None if none is pending."""
        if self._late is None:
            return None
        (step, late), self._late = self._late, None
        return self._report(step, GuardReading(*late.values()), ctx)

    def check(self, step: int, ctx: DistContext) -> GuardReading:
        """`read`, and warn (main rank) about the updates skipped since the last check."""
        return self._report(step, self.read(ctx), ctx)

    def _report(self, step: int, reading: GuardReading, ctx: DistContext) -> GuardReading:
        if reading.skipped > self._reported and ctx.is_main:
            log.warning("non-finite loss or gradient norm: %d update(s) skipped by step %d (the latest at step %d), "
                        "%d in a row now; the run stops at %d in a row (--max-bad-steps)",
                        reading.skipped - self._reported, step, reading.last_skipped, reading.streak,
                        self.max_bad_steps)
        self._reported = reading.skipped
        return reading

    def raise_if_tripped(self, reading: GuardReading, step: int) -> None:
        """NonFiniteError (on every rank: the reading is the same) once the streak has reached --max-bad-steps."""
        if not reading.tripped_at:
            return
        first = reading.tripped_at - self.max_bad_steps + 1
        raise NonFiniteError(
            f"the loss or gradient norm was not finite at {self.max_bad_steps} consecutive steps "
            f"({first}-{reading.tripped_at}; --max-bad-steps {self.max_bad_steps}); stopped at step {step}. "
            f"No update from step {first} on was applied and no checkpoint was written after step {first - 1}. "
            f"To continue: {self.advice}, or allow longer runs of bad steps with a larger --max-bad-steps")

    def check_due(self, step: int) -> bool:
        """Every --max-bad-steps steps the loop checks even without a log or save (reading it one step later): a
        latched run stops at most as many steps after it trips (it applies nothing meanwhile)."""
        return step % self.max_bad_steps == 0


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
                   grad_divisor: torch.Tensor | None = None) -> None:
    """optimizer.step(), which a fused optimizer turns into a no-op on the device when `grad_norm` is not finite:
    it reads GradScaler's `found_inf` attribute and leaves parameters, moments and step counts as they were.
    `grad_divisor` (a device scalar, or None): the fused kernel divides each gradient by it as it reads it (GradScaler's
    `grad_scale` attribute, here the clipping: `clip_divisor`); torch's stores the quotient back, the Triton AdamW
    (`fused_kernels.triton.adamw.TritonAdamW`) does not."""
    optimizer.found_inf = (~torch.isfinite(grad_norm)).float()  # type: ignore[attr-defined]
    if grad_divisor is not None:
        optimizer.grad_scale = grad_divisor  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
        if grad_divisor is not None:
            del optimizer.grad_scale  # type: ignore[attr-defined]


def clip_divisor(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping to `max_norm` divides every gradient by: max(1, (norm + 1e-6) / max_norm), the reciprocal of
    torch's clip coefficient min(1, max_norm / (norm + 1e-6)). Handed to the fused AdamW (`step_if_finite`), the
    clipping costs no pass of its own over the gradients (a multiply reads and writes each one first)."""
    return torch.clamp((grad_norm.float() + 1e-6) / max_norm, min=1.0)


def _parse_faults(spec: str, rank: int) -> dict[int, str]:
    """{step: kind} of GPT2_TEST_NONFINITE for this rank."""
    faults: dict[int, str] = {}
    for item in spec.split(","):
        m = _FAULT.match(item.strip())
        if not m:
            raise ValueError(f"{FAULT_ENV}: {item!r} is not KIND@STEP[-STEP][/RANK] with KIND loss or grad")
        kind, first, last, only = m.groups()
        if only is None or int(only) == rank:
            faults.update(dict.fromkeys(range(int(first), int(last or first) + 1), kind))
    return faults


def install_fault_injection(module: torch.nn.Module, grad_accum: int, start_step: int, rank: int) -> None:
    """Test-only: with GPT2_TEST_NONFINITE set, a forward hook makes the training loss of the listed steps
    non-finite (see the module docstring). Counts training-mode forwards: grad_accum of them per step."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    faults = _parse_faults(spec, rank)
    forwards = count()

    def hook(mod: torch.nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> Any:
        if not mod.training:
            return None
        kind = faults.get(start_step + 1 + next(forwards) // grad_accum)
        if kind is None:
            return None
        loss, correct = output
        if kind == "loss":
            return loss + float("nan"), correct  # the value only: d(loss + c)/dloss = 1
        loss.register_hook(lambda grad: grad * float("inf"))
        return None

    module.register_forward_hook(hook)
