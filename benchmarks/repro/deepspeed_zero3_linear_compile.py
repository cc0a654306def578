"""Standalone repro: DeepSpeed's ZeRO-3 linear loses its gradients under torch.compile.

`deepspeed.zero.Init` with `zero_optimization.memory_efficient_linear` true (DeepSpeed's default) replaces
`torch.nn.functional.linear` process-wide by `LinearFunctionForZeroStage3.apply`. This script calls that function
on ordinary tensors, eagerly and under `torch.compile` with each backend, and compares the weight and bias
gradients. Seen on one H100, torch 2.11.0+cu130, DeepSpeed 0.19.8: every compiled backend (eager, aot_eager,
inductor), with and without bf16 autocast, gives a relative gradient error of 1.0; torch 2.13 on CPU is exact.
The harness sets memory_efficient_linear to false (gpt2/config/deepspeed_file.py: build_ds_config).

    python benchmarks/repro/deepspeed_zero3_linear_compile.py     # exit 1 while the bug is present
"""

import sys

import torch
from deepspeed.runtime.zero.linear import zero3_linear_wrap


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 32, device=device))
    bias = torch.nn.Parameter(torch.randn(64, device=device))
    x = torch.randn(2, 5, 32, device=device)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return (zero3_linear_wrap(x, weight, bias).float() ** 2).sum()

    def grads(fn, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weight.grad = bias.grad = None
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            fn(x).backward()
        return weight.grad.clone(), bias.grad.clone()

    bad = False
    print(f"torch {torch.__version__}, device {device}")
    for autocast in (False, True):
        ref_w, ref_b = grads(loss, autocast)
        for backend in ("eager", "aot_eager", "inductor"):
            torch._dynamo.reset()
            w, b = grads(torch.compile(loss, backend=backend), autocast)
            err_w = ((w - ref_w).norm() / ref_w.norm()).item()
            err_b = ((b - ref_b).norm() / ref_b.norm()).item()
            bad |= max(err_w, err_b) > 1e-2
            print(f"autocast={autocast!s:5} backend={backend:9} |grad W| {w.norm():.3e} (eager {ref_w.norm():.3e}) "
                  f"rel err W {err_w:.2e} b {err_b:.2e}")
    print("BUG PRESENT" if bad else "no bug")
    return int(bad)


if __name__ == "__main__":
    sys.exit(main())
