"""The `cuda` backend. On Hopper (sm_90), in the runs `gpt2.config.layout.RunLayout.whole_mlp` allows (per-block
graphs), the whole MLP is one op on the wgmma GEMM's fused epilogues (`fused_kernels.cuda.mlp`; docs/decisions.md).
Elsewhere the MLP up-projection's epilogue is our CUDA C++ bias+GELU kernel, except in torch.compile's whole-model
graph, where cuBLAS and Inductor's own bias+GELU ran faster end to end (`fused_kernels.get_ops`). The set steps with the
Triton AdamW where the engine keeps torch's AdamW state (`--optimizer auto`, `gpt2.config.cli.resolve_optimizer`):

linear(x, W, b, gelu=True) = bias_gelu(x @ W^T) with the matmul by cuBLAS (no bias) and bias + GELU
fused in one elementwise pass, as the custom ops `gpt2_fused::cuda_bias_gelu` (with autograd) and
`gpt2_fused::cuda_bias_gelu_backward`, so `torch.compile` traces it without a graph break; every other op
comes from `fused_kernels.reference`.
The extension is JIT-built on first use by torch.utils.cpp_extension.load for sm_80 and sm_90, and
cached under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so later runs only load it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from fused_kernels import KernelOps, KernelUnavailableError, reference
from fused_kernels.cuda import mlp
from fused_kernels.custom_ops import bias_gelu_ops

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = [SOURCE_DIR / "bias_gelu.cpp", SOURCE_DIR / "bias_gelu.cu"]
NVCC_FLAGS = [
    "-O3",  # no --use_fast_math: it turns tanhf into tanh.approx for fp32 too (bias_gelu.cu picks per dtype)
    "-gencode=arch=compute_80,code=sm_80",  # Ampere
    "-gencode=arch=compute_90,code=sm_90",  # Hopper
]


def check_cuda() -> None:
    if not torch.cuda.is_available():
        raise KernelUnavailableError("--fused-kernels cuda needs a CUDA GPU; use --fused-kernels none (or triton)")


@functools.cache
def load_extension() -> ModuleType:
    """Build (or load the cached build of) the bias+GELU extension; KernelUnavailableError on failure."""
    check_cuda()
    from torch.utils.cpp_extension import load

    try:
        return load(
            name="gpt2_bias_gelu",
            sources=[str(s) for s in SOURCES],
            extra_include_paths=[str(SOURCE_DIR)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=NVCC_FLAGS,
        )
    except (RuntimeError, OSError, ImportError) as e:  # no nvcc / ninja, compile or link error
        raise KernelUnavailableError(
            f"--fused-kernels cuda: building the bias+GELU CUDA extension failed ({e}); it needs nvcc and "
            "ninja matching PyTorch's CUDA version. Use --fused-kernels triton or none instead") from e


def _forward(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return load_extension().forward(x, bias)


def _backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return load_extension().backward(dy.contiguous(), x, bias)


# opaque custom ops (an extension launch cannot be traced); the fakes and autograd are the Triton bias+GELU's
bias_gelu_op, bias_gelu_backward_op = bias_gelu_ops("cuda", _forward, _backward, traced=False)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) by the CUDA kernel; bias is cast to x's dtype."""
    return bias_gelu_op(x.contiguous(), bias.to(x.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """cuBLAS matmul, then the fused CUDA bias+GELU epilogue when `gelu` (else plain F.linear)."""
    if not gelu or bias is None:
        return reference.linear(x, weight, bias, gelu)
    return bias_gelu(F.linear(x, weight), bias)  # F.linear follows autocast; bias follows its output dtype


def linear_pair(x: torch.Tensor, w_fc: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor,
                b_proj: torch.Tensor) -> torch.Tensor:
    """The MLP as two `linear`s: up-projection with the fused bias+GELU, then the down-projection."""
    return linear(linear(x, w_fc, b_fc, True), w_proj, b_proj, False)


def cuda_ops(*, whole_mlp: bool, elementwise: bool) -> KernelOps:
    """The cuda backend's ops; builds the extensions it will use now, so a failure is reported at start-up. Where
    `whole_mlp` allows it and the GPU is a Hopper, the MLP is one op on the wgmma kernel (`fused_kernels.cuda.mlp`);
    elsewhere its up-projection uses the bias+GELU kernel, built only where `elementwise` says it runs (Inductor's
    replaces it in a whole-model graph)."""
    check_cuda()
    if elementwise:
        load_extension()
    mlp_op = None
    if whole_mlp and mlp.hopper():
        mlp.load_wgmma_extension()
        mlp_op = functools.partial(mlp.mlp, linear_pair=linear_pair)
    return KernelOps(name="cuda", linear=linear, add_layernorm=reference.add_layernorm,
                     lm_cross_entropy=reference.lm_cross_entropy, mlp=mlp_op, inductor_fuses_elementwise=True)
