"""The `triton` backend: fused matmul+bias+GELU, residual-add+LayerNorm and chunked LM cross-entropy.

Each kernel is a PyTorch custom op with a fake implementation and registered autograd
(`fused_kernels.custom_ops`), so `torch.compile` traces a model using them without graph breaks.
Importing this package decorates the kernels and registers the ops, so TRITON_INTERPRET=1 must be set
before it is imported for the kernels to run on the CPU (and GPT2_OPAQUE_KERNELS=1 for opaque ops).
"""

from __future__ import annotations

import torch

from fused_kernels import KernelOps, reference
from fused_kernels.triton.cross_entropy import lm_cross_entropy
from fused_kernels.triton.layernorm import add_layernorm
from fused_kernels.triton.matmul_gelu import linear_gelu, matmul_bias_gelu_kernel
from fused_kernels.triton.runtime import check_available


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """The fused matmul+bias+GELU kernel for the MLP up-projection; plain F.linear otherwise."""
    return linear_gelu(x, weight, bias) if gelu else reference.linear(x, weight, bias, gelu=False)


def triton_ops() -> KernelOps:
    """The triton backend's ops; KernelUnavailableError if the kernels cannot run on this machine."""
    check_available(matmul_bias_gelu_kernel)
    return KernelOps(name="triton", linear=linear, add_layernorm=add_layernorm, lm_cross_entropy=lm_cross_entropy)
