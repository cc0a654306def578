"""Reading a small device tensor on the host one step late, so the host never waits for the step in flight.

`tensor.item()` / `.tolist()` on a CUDA tensor queues its copy on the current stream behind everything launched so
far and waits for it: called after a step, the host stalls until the device has finished that step, and a host-bound
step then starts with the device idle. `LateRead` queues the copy at once (into pinned memory, behind the work that
produced the tensor) and records an event; `values()`, called a step later, waits only for that event. The training
loop's preemption agreement and the non-finite guard's periodic check read this way (`gpt2.train.preemption`,
`gpt2.engines.guard`); every rank starts and finishes its reads at the same steps, so they still agree.
"""

from __future__ import annotations

import torch


class LateRead:
    """The values of `tensor` as of now, for the host later: a pinned copy queued behind the work that produced it
    (CUDA), or the tensor itself (CPU, where ops are already done when they return)."""

    def __init__(self, tensor: torch.Tensor):
        self._event: torch.cuda.Event | None = None
        if tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._tensor = tensor

    def values(self) -> list:
        """The tensor's values (`tolist()`), once its copy has landed."""
        if self._event is not None:
            self._event.synchronize()
        return self._tensor.tolist()
