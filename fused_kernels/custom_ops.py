"""Fused kernels as PyTorch custom ops (`torch.ops.gpt2_fused.*`): one registration path for both backends.

Every kernel launch sits in an operator with a fake (meta) implementation, and every differentiable one has its
backward registered with `register_autograd` (the backward kernels are operators too), so
`torch.compile(fullgraph=True)` traces a model that uses them as one graph, without graph breaks, and Inductor
can fuse the PyTorch ops around them. An op is registered one of two ways:

- traced, `torch.library.triton_op`: the body (PyTorch ops and `wrap_triton` launches) is its own fake, and
  AOTAutograd decomposes it, so Inductor sees the Triton kernels and the PyTorch ops between them;
- opaque, `torch.library.custom_op` with an explicit fake: Inductor calls the op like an extern kernel. Used for
  the CUDA extension, for Triton kernels under the CPU interpreter (`wrap_triton` cannot trace interpreted
  kernels), for the chunked LM-head cross-entropy (see `fused_kernels.triton.cross_entropy`), and for every
  Triton op when GPT2_OPAQUE_KERNELS=1 is set before the backend is imported: the fallback should Inductor's
  handling of a traced kernel misbehave on some device or torch version.

The backends import this module; importing `fused_kernels` alone registers nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch._library.triton import set_wrap_triton_enabled  # what triton_op itself uses for eager calls
from torch.library import CustomOpDef, custom_op, infer_schema, triton_op

NAMESPACE = "gpt2_fused"
OPAQUE_ENV = "GPT2_OPAQUE_KERNELS"


def opaque_requested() -> bool:
    """True if GPT2_OPAQUE_KERNELS asks for every Triton op to be registered opaque (read at registration)."""
    return os.environ.get(OPAQUE_ENV, "0") not in ("", "0")


def kernel_op(name: str, *, fake: Callable, traced: bool) -> Callable[[Callable], CustomOpDef]:
    """Decorator: register the annotated function as `torch.ops.gpt2_fused.<name>` (no argument is mutated).

    traced: a `triton_op`, whose body must be make_fx-traceable with every Triton launch written as
    `wrap_triton(kernel)[grid](...)` (also how torch finds the kernels for its compile-cache keys); `fake` is
    then unused. Otherwise a `custom_op` with `fake` as its fake implementation, run with `wrap_triton`
    returning the kernel itself, as `triton_op` does in eager (dispatching each launch as a traceable
    higher-order op would cost more host time than the kernel saves: docs/decisions.md).
    """

    def register(fn: Callable) -> CustomOpDef:
        qualname = f"{NAMESPACE}::{name}"
        if traced:
            return triton_op(qualname, fn, mutates_args=())

        def run(*args, **kwargs):
            with set_wrap_triton_enabled(False):
                return fn(*args, **kwargs)

        op = custom_op(qualname, run, mutates_args=(), schema=infer_schema(fn, mutates_args=()))
        op.register_fake(fake)
        return op

    return register


def _like_x(x: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def bias_gelu_ops(
    prefix: str, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], backward: Callable[..., torch.Tensor],
    *, traced: bool,
) -> tuple[CustomOpDef, CustomOpDef]:
    """Register `<prefix>_bias_gelu(x, bias) = gelu_tanh(x + bias)` and `<prefix>_bias_gelu_backward(dy, x, bias)
    = dy * gelu_tanh'(x + bias)`, with fakes, and the forward's autograd: the backward op for dx, and
    db = sum_rows dx accumulated in fp32. Shared by the Triton and CUDA backends (and their CPU tests).

    `forward(x, bias)` and `backward(dy, x, bias)` are given contiguous x and dy and bias [N] in x's dtype
    (the callers' job, so the saved x needs no copy); both return a new contiguous tensor shaped like x.
    """
    fwd = kernel_op(f"{prefix}_bias_gelu", fake=_like_x, traced=traced)(forward)
    bwd = kernel_op(f"{prefix}_bias_gelu_backward", fake=lambda dy, x, bias: _like_x(x), traced=traced)(backward)

    def setup_context(ctx, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)  # x (pre-bias) and bias: gelu' is recomputed, y is not kept

    def grad(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, bias = ctx.saved_tensors
        dx = bwd(dy.contiguous(), x, bias)  # [..., N]
        db = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)  # [N]
        return dx, db

    fwd.register_autograd(grad, setup_context=setup_context)
    return fwd, bwd
