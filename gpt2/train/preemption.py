"""Preemption: on SIGUSR1 or SIGTERM, checkpoint at the next step boundary and exit with EXIT_PREEMPTED.

The handler only records the signal: it runs between two bytecodes of whatever the main thread is doing
(a collective, a checkpoint write), so it does no I/O and no communication. The training loop calls
`should_stop()` after every optimizer step: an all-reduce MAX of the flag over the whole world, so a signal
that reached one rank, or reached the ranks during different steps, still stops every rank after the same
step; they all save that step and exit together.

Exit code: EXIT_PREEMPTED (75, sysexits' EX_TEMPFAIL: "try again later") after the preemption checkpoint;
0 when training finished. A launcher may flatten it (torchrun exits 1 when a worker exits non-zero), so
the Slurm scripts decide to requeue from "the signal came and the step did not exit 0" (slurm/common.sh
documents the whole chain).
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from gpt2.runtime.distributed import DistContext

EXIT_PREEMPTED = 75
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(Exception):
    """Raised by the training loop after the preemption checkpoint of `step` (None: `unsaved` says why not)."""

    def __init__(self, step: int, signum: int, checkpoint: str | None, unsaved: str = "no --save-dir, nothing saved"):
        name = signal.Signals(signum).name if signum else "a peer's signal"
        outcome = f"checkpoint {checkpoint}" if checkpoint else unsaved
        super().__init__(f"preempted by {name} after step {step}; {outcome}")
        self.step, self.checkpoint = step, checkpoint


class PreemptionWatcher:
    """Installs the handlers on construction (main thread only), `restore` puts back the ones it replaced (train.main
    called in-process, e.g. by a test or a notebook, must not leave SIGTERM ignored); `should_stop` is collective."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPT_SIGNALS):
        self.received = 0  # signal number of the last preemption signal this process got; 0: none
        self._replaced = {sig: signal.signal(sig, self._handle) for sig in signals}

    def restore(self) -> None:
        for sig, handler in self._replaced.items():
            if handler is not None:  # None: a handler installed from C, which Python cannot put back
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def should_stop(self, ctx: DistContext) -> bool:
        """True on every rank iff any rank has received a signal (one all-reduce of one element)."""
        if not ctx.distributed:
            return bool(self.received)
        flag = torch.tensor([float(self.received)], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
