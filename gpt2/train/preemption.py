"""Preemption and Ctrl-C: on SIGUSR1, SIGTERM or SIGINT, checkpoint at the next step boundary and exit.

The handler only records the signal: it runs between two bytecodes of whatever the main thread is doing
(a collective, a checkpoint write), so it does no buffered I/O and no communication. The training loop calls
`should_stop()` after every optimizer step: an all-reduce MAX of the flag over the whole world, so a signal
that reached one rank, or reached the ranks during different steps, still stops every rank after the same
step; they all save that step and exit together. Each call reads the all-reduce of the call before (one step
later, `gpt2.runtime.readback.LateRead`): reading this step's at once would make the host wait for the device every
step, which stalls a host-bound step; every rank reads the same reduced value at the same step, so they still agree,
one step later.

Ctrl-C (SIGINT) is the same stop, for a user at a terminal: a line on stderr says a checkpoint follows at the step
boundary; a second Ctrl-C raises KeyboardInterrupt at once (mid-step or mid-save: a save's `.tmp` folder is never
read, so the save dir stays resumable), which train.py turns into one line, exit EXIT_INTERRUPTED.

Exit code: EXIT_PREEMPTED (75, sysexits' EX_TEMPFAIL: "try again later") after the preemption checkpoint;
EXIT_INTERRUPTED (130, a shell's 128 + SIGINT) after a Ctrl-C; 0 when training finished. A launcher may flatten it
(torchrun exits 1 when a worker exits non-zero), so the Slurm scripts decide to requeue from "the signal came and
the step did not exit 0" (slurm/common.sh documents the whole chain).
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at import: train.py installs the watcher before torch loads (seconds)
    from gpt2.runtime.distributed import DistContext
    from gpt2.runtime.readback import LateRead

EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# watched from the process's first moment (train.py); SIGINT only once training starts: a Ctrl-C before that stops at
# once (KeyboardInterrupt), as there is nothing to checkpoint
STARTUP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_CTRL_C = b"Ctrl-C: stopping after this step, with a checkpoint if --save-dir is set; Ctrl-C again stops at once\n"


class Preempted(Exception):
    """Raised by the training loop after the preemption checkpoint of `step` (None: `unsaved` says why not).
    `came_after`: the last step checked before this process's own signal came (None: before the run's first step
    ended, or a peer's signal), which the message states so that a user (and the tests) see how soon the stop
    followed."""

    def __init__(self, step: int, signum: int, checkpoint: str | None, unsaved: str = "no --save-dir, nothing saved",
                 came_after: int | None = None):
        name = signal.Signals(signum).name if signum else "a peer's signal"
        outcome = f"checkpoint {checkpoint}" if checkpoint else unsaved
        verb = "interrupted" if signum == signal.SIGINT else "preempted"
        came = "" if not signum else (f"; the signal came after step {came_after}" if came_after is not None
                                      else "; the signal came before the run's first step ended")
        super().__init__(f"{verb} by {name} after step {step}; {outcome}{came}")
        self.step, self.checkpoint, self.signum = step, checkpoint, signum

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.signum == signal.SIGINT else EXIT_PREEMPTED


class PreemptionWatcher:
    """Installs the handlers on construction (main thread only), `restore` puts back the ones it replaced (train.main
    called in-process, e.g. by a test or a notebook, must not leave SIGTERM ignored); `should_stop` is collective."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPT_SIGNALS):
        self.received = 0  # signal number of the last preemption signal this process got; 0: none
        self.checked: int | None = None  # the last step `should_stop` was called after
        self.came_after: int | None = None  # `checked` when the first signal came
        self._pending: LateRead | None = None  # the last call's all-reduced flag, read by the next call
        self._replaced = {sig: signal.signal(sig, self._handle) for sig in signals}

    def watch(self, sig: signal.Signals) -> None:
        """Handle `sig` too from now on (`restore` puts its handler back as well)."""
        if sig not in self._replaced:
            self._replaced[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._replaced.items():
            if handler is not None:  # None: a handler installed from C, which Python cannot put back
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.received == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            os.write(2, _CTRL_C)  # stderr, unbuffered: the handler may run inside a buffered write
        if not self.received:
            self.came_after = self.checked
        self.received = signum

    def should_stop(self, ctx: DistContext, step: int) -> bool:
        """After `step`: True on every rank iff any rank had received a signal by the previous call (distributed: one
        all-reduce of one element a call, whose result the next call reads; one process: this call's flag)."""
        self.checked = step
        if not ctx.distributed:
            return bool(self.received)
        import torch
        import torch.distributed as dist

        from gpt2.runtime.readback import LateRead

        flag = torch.full((1,), float(self.received), device=ctx.device)  # a fill on the device: no host copy
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        previous, self._pending = self._pending, LateRead(flag)
        return previous is not None and bool(previous.values()[0])
