"""The `triton` backend: fused matmul+bias+GELU, residual-add+LayerNorm and chunked LM cross-entropy.

Importing this package decorates the kernels, so TRITON_INTERPRET=1 must be set before it is
imported for the kernels to run on the CPU.
"""

from __future__ import annotations

import torch

from fused_kernels import KernelOps, reference
from fused_kernels.triton.cross_entropy import lm_cross_entropy
from fused_kernels.triton.layernorm import add_layernorm
from fused_kernels.triton.matmul_gelu import linear_gelu, matmul_bias_gelu_kernel
from fused_kernels.triton.runtime import check_available

# Opaque to torch.compile: Dynamo would trace into these raw Triton launches (user-defined kernel capture). That
# crashed inside the compiled LM head on H200 (an illegal memory access in an Inductor kernel next to the
# cross-entropy chunks) and fails under the interpreter, so under --compile each runs eagerly, with a graph break.
_linear_gelu = torch.compiler.disable(linear_gelu)
_add_layernorm = torch.compiler.disable(add_layernorm)
_lm_cross_entropy = torch.compiler.disable(lm_cross_entropy)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """The fused matmul+bias+GELU kernel for the MLP up-projection; plain F.linear otherwise."""
    return _linear_gelu(x, weight, bias) if gelu else reference.linear(x, weight, bias, gelu=False)


def triton_ops() -> KernelOps:
    """The triton backend's ops; KernelUnavailableError if the kernels cannot run on this machine."""
    check_available(matmul_bias_gelu_kernel)
    return KernelOps(name="triton", linear=linear, add_layernorm=_add_layernorm, lm_cross_entropy=_lm_cross_entropy)
