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


def wrap_triton(kernel: object) -> object:
    """`torch.library.wrap_triton(kernel)`, or the kernel itself when Triton's CPU interpreter runs it: an interpreted
    function launches eagerly but cannot be traced. torch 2.13's wrap_triton returns it unwrapped; 2.11's (the GPU
    machines') raises on it, which kept the fused-kernel TP checks off torch 2.11 under TRITON_INTERPRET=1."""
    return kernel if is_interpreted(kernel) else torch.library.wrap_triton(kernel)
