"""Standalone measurement: what a Triton launch costs the host in a forward and in a backward pass.

Why: eager `--fused-kernels triton` steps are host-bound. On one H100 (2026-11-25, torch 2.11, triton 3.6) a
bias+GELU forward + backward through our custom op took 0.50 ms of wall time with its Triton kernels. With the
CUDA extension's kernels behind the same op wrappers it took 0.16 ms. A Triton forward alone took 0.05 ms
(benchmarks/results/kernels). The extra time sits in the backward, which PyTorch runs on its autograd device
thread. This script separates the suspects on tiny tensors, where the GPU work is negligible and wall time is
host time:

    aten         x * 2 (forward) / the same in backward
    triton       one Triton launch doing the same, in forward / in backward
    custom-op    the Triton launch behind torch.library.custom_op + register_autograd (how fused_kernels calls it)

Each backward case also runs with `torch.autograd.set_multithreading_enabled(False)`, which runs the backward on
the calling thread instead of the autograd device thread. If the Triton-in-backward cost vanishes there, the
device thread is the cause.

    python benchmarks/repro/triton_launch_in_backward.py             # on a GPU: microseconds per call
    TRITON_INTERPRET=1 python benchmarks/repro/triton_launch_in_backward.py --iters 3   # CPU smoke run only

Under TRITON_INTERPRET=1 the kernels run in Triton's interpreter, so the numbers say nothing about launches.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)


def triton_scale(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    scale_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


class AtenBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        return dy * 2


class TritonBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return triton_scale(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        return triton_scale(dy.contiguous())


@torch.library.custom_op("repro_launch::scale", mutates_args=())
def scale_op(x: torch.Tensor) -> torch.Tensor:
    return triton_scale(x)


@scale_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


scale_op.register_autograd(lambda ctx, dy: scale_op(dy.contiguous()))


def us_per_call(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Wall microseconds per call over `iters` calls after a warm-up: host time when the kernels are tiny."""
    for _ in range(max(3, iters // 10)):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def measure(iters: int, device: torch.device) -> dict[str, float]:
    x = torch.randn(8, 1024, device=device)
    leaf = x.clone().requires_grad_(True)

    def forward_only(fn: Callable) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return fn(x)
        return call

    def forward_backward(fn: Callable, threaded: bool) -> Callable[[], object]:
        def call() -> None:
            leaf.grad = None
            with torch.autograd.set_multithreading_enabled(threaded):
                fn(leaf).sum().backward()
        return call

    results = {"fwd aten": us_per_call(forward_only(lambda t: t * 2), iters, device),
               "fwd triton": us_per_call(forward_only(triton_scale), iters, device)}
    for threaded in (True, False):
        thread = "device thread" if threaded else "calling thread"
        for name, fn in (("aten", AtenBackward.apply), ("triton", TritonBackward.apply), ("custom-op", scale_op)):
            results[f"fwd+bwd {name}, backward on the {thread}"] = us_per_call(
                forward_backward(fn, threaded), iters, device)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (interpreter: not launch costs)'}")
    for name, us in measure(args.iters, device).items():
        print(f"{name:55s} {us:9.1f} us/call")


if __name__ == "__main__":
    main()
