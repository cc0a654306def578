"""Where a Triton kernel runs: the CPU interpreter or a GPU (the backend's start-up check is in `fused_kernels.triton`).

Triton decides at decoration time whether a `@triton.jit` kernel is compiled for a GPU or run by
the CPU interpreter (TRITON_INTERPRET=1), so the check inspects a real kernel object.
"""

from __future__ import annotations

import torch
import triton


def is_interpreted(kernel: object) -> bool:
    """True if `kernel` (a jitted or autotuned function) runs in Triton's CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    while isinstance(kernel, triton.runtime.Autotuner | triton.runtime.Heuristics):
        kernel = kernel.fn
    return isinstance(kernel, InterpretedFunction)


def default_device(kernel: object) -> torch.device:
    """Where tensors for `kernel` should live: the GPU when compiled, the CPU when interpreted."""
    return torch.device("cpu") if is_interpreted(kernel) else torch.device("cuda")
