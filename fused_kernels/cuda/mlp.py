"""GPT-2's whole MLP as one custom op on Hopper, on the GEMM study's wgmma kernel (gemm_wgmma_persistent.cu here;
the study itself is `benchmarks/gemm/`).

y = (GELU_tanh(x W_fc^T + b_fc)) W_proj^T + b_proj, as `torch.ops.gpt2_fused.cuda_mlp`. The forward's up-projection
epilogue writes h = GELU(pre) and the pre-activation pre (`wgmma_persistent_bias_gelu_aux`). The backward's
down-projection dgrad applies GELU's backward and accumulates b_fc's gradient in its epilogue
(`wgmma_persistent_dgelu`, `gpt2_fused::cuda_mlp_dgelu`). The down-projection's forward, the weight gradients and dx
are cuBLAS. One op, not two Linears, because GELU's backward fuses into the *down*-projection's GEMM (against eager's
separate ops: docs/decisions.md).

sm_90 only (wgmma, TMA); the kernels are bf16, so the op runs under bf16 autocast, and the caller keeps the two
Linears elsewhere (`linear_pair`). Used only where `gpt2.config.layout.RunLayout.whole_mlp` allows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from fused_kernels import KernelUnavailableError
from fused_kernels.custom_ops import kernel_op

# the sources live in this package (package data: an installed wheel builds from them); the GEMM study in
# benchmarks/gemm/ builds its ladder with gemm_binding.cpp and gemm_kernels.h from here too
SOURCE_DIR = Path(__file__).resolve().parent
WGMMA_SOURCES = [SOURCE_DIR / f for f in ("gemm_wgmma.cu", "gemm_wgmma_persistent.cu", "gemm_binding.cpp")]
# sm_90a only: an arch flag in extra_cuda_cflags replaces torch's own -gencode list; -DGEMM_WGMMA selects the binding
WGMMA_CUDA_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-gencode=arch=compute_90a,code=sm_90a"]


def hopper() -> bool:
    """The wgmma kernels run here: a CUDA device of compute capability 9.0."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@functools.cache
def load_wgmma_extension(verbose: bool = False) -> ModuleType:
    """Build (or load the cached build of) the wgmma GEMMs and their fused epilogues; the GEMM benchmark
    (benchmarks/gemm/bench.py) loads the same build."""
    from torch.utils.cpp_extension import load

    try:
        return load(name="gemm_wgmma", sources=[str(s) for s in WGMMA_SOURCES], extra_cuda_cflags=WGMMA_CUDA_FLAGS,
                    extra_cflags=["-O3", "-DGEMM_WGMMA"], verbose=verbose)
    except (RuntimeError, OSError, ImportError) as e:  # no nvcc / ninja, compile or link error
        raise KernelUnavailableError(
            f"--fused-kernels cuda: building the wgmma MLP extension failed ({e}); it needs nvcc (CUDA >= 12) and "
            "ninja. Use --fused-kernels triton or none instead") from e


def _up(x: torch.Tensor, w_fc_t: torch.Tensor, b_fc: torch.Tensor, h: torch.Tensor, pre: torch.Tensor) -> None:
    """h = GELU(x @ w_fc_t + b_fc), pre = x @ w_fc_t + b_fc, written in place."""
    load_wgmma_extension().wgmma_persistent_bias_gelu_aux(x, w_fc_t, b_fc, h, pre)


def _dgelu(dy: torch.Tensor, w_proj: torch.Tensor, pre: torch.Tensor, dpre: torch.Tensor, db: torch.Tensor) -> None:
    """dpre = (dy @ w_proj) * GELU'(pre), db += column sums of dpre (fp32), written in place."""
    load_wgmma_extension().wgmma_persistent_dgelu(dy, w_proj, pre, dpre, db)


# the kernels the ops launch; CPU tests swap in PyTorch versions to check the ops' autograd without a GPU
KERNELS: dict[str, Callable[..., None]] = {"up": _up, "dgelu": _dgelu}


def _mlp_fake(x: torch.Tensor, w_fc_t: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor,
              b_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, hidden = x.shape[0], w_fc_t.shape[1]
    return x.new_empty(tokens, w_proj.shape[0]), x.new_empty(tokens, hidden), x.new_empty(tokens, hidden)


@kernel_op("cuda_mlp", fake=_mlp_fake, traced=False)
def mlp_op(x: torch.Tensor, w_fc_t: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor,
           b_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, d], w_fc_t [d, 4d] (W_fc transposed: the kernel's B is [K, N]), b_fc [4d], w_proj [d, 4d] (as
    nn.Linear keeps it), b_proj [d], all contiguous bf16 -> (y [T, d], pre [T, 4d], h [T, 4d]); pre and h are
    outputs so that autograd can save them."""
    tokens, hidden = x.shape[0], w_fc_t.shape[1]
    h, pre = x.new_empty(tokens, hidden), x.new_empty(tokens, hidden)
    KERNELS["up"](x, w_fc_t, b_fc, h, pre)
    return torch.addmm(b_proj, h, w_proj.t()), pre, h  # [T, d]


@kernel_op("cuda_mlp_dgelu", fake=lambda dy, w_proj, pre: (torch.empty_like(pre),
                                                           pre.new_empty(pre.shape[1], dtype=torch.float32)),
           traced=False)
def dgelu_op(dy: torch.Tensor, w_proj: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dpre [T, 4d] = (dy @ w_proj) * GELU'(pre), db_fc [4d] fp32 = column sums of dpre)."""
    dpre = torch.empty_like(pre)
    db = torch.zeros(pre.shape[1], device=pre.device, dtype=torch.float32)  # the epilogue accumulates into it
    KERNELS["dgelu"](dy, w_proj, pre, dpre, db)
    return dpre, db


def _setup_context(ctx, inputs: tuple[torch.Tensor, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, w_fc_t, _, w_proj, _ = inputs
    _, pre, h = output
    ctx.save_for_backward(x, w_fc_t, w_proj, pre, h)
    ctx.set_materialize_grads(False)  # pre's and h's gradients are unused: no [T, 4d] zero tensors for them


def _backward(ctx, dy: torch.Tensor, _dpre: torch.Tensor | None, _dh: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    x, w_fc_t, w_proj, pre, h = ctx.saved_tensors  # pre and h feed nothing outside the op: their grads are None
    dy = dy.contiguous()
    dpre, db_fc = dgelu_op(dy, w_proj, pre)  # [T, 4d], [4d]
    return (dpre @ w_fc_t.t(),  # dx [T, d]
            x.t() @ dpre,  # d w_fc_t [d, 4d]
            db_fc.to(pre.dtype),  # the op's b_fc is bf16, as eager's bf16 bias sum
            dy.t() @ h,  # d w_proj [d, 4d]
            dy.sum(0))  # d b_proj [d]


mlp_op.register_autograd(_backward, setup_context=_setup_context)


def mlp(x: torch.Tensor, w_fc: torch.Tensor, b_fc: torch.Tensor, w_proj: torch.Tensor, b_proj: torch.Tensor,
        linear_pair: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The MLP of x [..., d] with nn.Linear's weights (w_fc [4d, d], w_proj [d, 4d]): the fused op under bf16
    autocast (inputs cast as autocast casts F.linear's), else `linear_pair(x, w_fc, b_fc, w_proj, b_proj)`."""
    if not (torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16):
        return linear_pair(x, w_fc, b_fc, w_proj, b_proj)
    bf16 = torch.bfloat16
    y, _, _ = mlp_op(x.reshape(-1, x.shape[-1]).to(bf16).contiguous(), w_fc.to(bf16).t().contiguous(),
                     b_fc.to(bf16), w_proj.to(bf16).contiguous(), b_proj.to(bf16))
    return y.view(*x.shape[:-1], y.shape[-1])
