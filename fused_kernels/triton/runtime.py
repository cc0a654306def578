"""Whether the Triton kernels can run here, decided once when the backend is requested.

Triton decides at decoration time whether a `@triton.jit` kernel is compiled for a GPU or run by
the CPU interpreter (TRITON_INTERPRET=1), so the check inspects a real kernel object.
"""

from __future__ import annotations

import torch
import triton

from fused_kernels import KernelUnavailableError


def is_interpreted(kernel: object) -> bool:
    """True if `kernel` (a jitted or autotuned function) runs in Triton's CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    while isinstance(kernel, triton.runtime.Autotuner | triton.runtime.Heuristics):
        kernel = kernel.fn
    return isinstance(kernel, InterpretedFunction)


def default_device(kernel: object) -> torch.device:
    """Where tensors for `kernel` should live: the GPU when compiled, the CPU when interpreted."""
    return torch.device("cpu") if is_interpreted(kernel) else torch.device("cuda")


def check_available(kernel: object) -> None:
    """Raise KernelUnavailableError unless `kernel` can run: interpreted, or compiled with a CUDA GPU present."""
    if is_interpreted(kernel):
        return
    if not torch.cuda.is_available():
        raise KernelUnavailableError(
            "--fused-kernels triton needs a CUDA GPU, or TRITON_INTERPRET=1 set before the kernels are imported "
            "to run them (slowly) on the CPU; use --fused-kernels none otherwise")
    _smoke_test()


def _smoke_test() -> None:
    """Compile and run one small kernel so a broken Triton/driver install fails at start-up, not mid-run."""
    from fused_kernels.triton.layernorm import add_layernorm

    x = torch.randn(4, 64, device="cuda")
    try:
        add_layernorm(x, x, torch.ones(64, device="cuda"), torch.zeros(64, device="cuda"), 1e-5)
        torch.cuda.synchronize()
    except Exception as e:  # any compiler / driver failure
        raise KernelUnavailableError(f"--fused-kernels triton: the Triton kernels failed to compile or run: {e}") from e
