"""The `triton` backend: bias+GELU after the up-projection's cuBLAS matmul, residual-add+LayerNorm and chunked
LM cross-entropy.

Each op is used in training only where it ran faster than what it replaces at GPT-2 Large's training shapes
(docs/decisions.md): the one-kernel matmul+bias+GELU (`matmul_gelu`, kept for the kernel benchmark) was slower
than cuBLAS + GELU, so the up-projection is cuBLAS followed by the Triton bias+GELU. Where Inductor compiles the
whole model, `fused_kernels.get_ops` swaps bias+GELU and add+LayerNorm for the reference ops, which Inductor fuses
with their neighbours (faster end to end there); the chunked cross-entropy stays (faster than Inductor's head).
The set's optimizer, the Triton AdamW (`fused_kernels.triton.adamw`; the
cuda set's too), runs outside the graph wherever the engine keeps torch's AdamW state (`--optimizer auto`,
`gpt2.config.cli.resolve_optimizer`).

Each kernel is a PyTorch custom op with a fake implementation and registered autograd
(`fused_kernels.custom_ops`), so `torch.compile` traces a model using them without graph breaks.
Importing this package decorates the kernels and registers the ops, so TRITON_INTERPRET=1 must be set
before it is imported for the kernels to run on the CPU (and GPT2_OPAQUE_KERNELS=1 for opaque ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fused_kernels import KernelOps, KernelUnavailableError, reference
from fused_kernels.triton.bias_gelu import bias_gelu
from fused_kernels.triton.cross_entropy import lm_cross_entropy
from fused_kernels.triton.gelu import bias_gelu_fwd_kernel
from fused_kernels.triton.layernorm import add_layernorm
from fused_kernels.triton.runtime import is_interpreted


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """cuBLAS matmul, then the Triton bias+GELU when `gelu` (the MLP up-projection); plain F.linear otherwise."""
    if not gelu or bias is None:
        return reference.linear(x, weight, bias, gelu)
    return bias_gelu(F.linear(x, weight), bias)  # F.linear follows autocast; bias follows its output dtype


def check_available(kernel: object, flag: str = "--fused-kernels triton", fix: str = "--fused-kernels none") -> None:
    """Raise KernelUnavailableError unless `kernel` can run: interpreted, or compiled with a CUDA GPU present. `flag`
    is what asked for it, `fix` what to use instead."""
    if is_interpreted(kernel):
        return
    if not torch.cuda.is_available():
        raise KernelUnavailableError(
            f"{flag} needs a CUDA GPU, or TRITON_INTERPRET=1 set before the kernels are imported to run them "
            f"(slowly) on the CPU; use {fix} otherwise")
    _smoke_test(flag)


def _smoke_test(flag: str) -> None:
    """Compile and run one small kernel so a broken Triton/driver install fails at start-up, not mid-run."""
    x = torch.randn(4, 64, device="cuda")
    try:
        add_layernorm(x, x, torch.ones(64, device="cuda"), torch.zeros(64, device="cuda"), 1e-5)
        torch.cuda.synchronize()
    except Exception as e:  # any compiler / driver failure
        raise KernelUnavailableError(f"{flag}: the Triton kernels failed to compile or run: {e}") from e


def triton_ops(*, whole_mlp: bool, elementwise: bool) -> KernelOps:
    """The triton backend's ops (no whole-MLP op, whatever `whole_mlp` allows; its kernels compile on first use, so
    `elementwise` changes nothing here); KernelUnavailableError if the kernels cannot run on this machine."""
    check_available(bias_gelu_fwd_kernel)
    return KernelOps(name="triton", linear=linear, add_layernorm=add_layernorm, lm_cross_entropy=lm_cross_entropy,
                     inductor_fuses_elementwise=True)
