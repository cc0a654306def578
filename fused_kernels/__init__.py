"""One registry: backend name -> the set of (autograd-aware) operations the model delegates.

The model never imports a backend; it receives a `KernelOps` from `get_ops(backend)`.
Backends that cannot run on this machine raise `KernelUnavailableError` at start-up
instead of silently falling back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fused_kernels import reference


class KernelUnavailableError(RuntimeError):
    """The requested fused-kernel backend cannot run here; the message says why and what to use."""


@dataclass(frozen=True)
class KernelOps:
    """The operations a GPT-2 block delegates. Signatures follow `fused_kernels.reference`."""

    name: str
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]
    add_layernorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    lm_cross_entropy: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # the whole MLP, mlp(x, w_fc, b_fc, w_proj, b_proj) -> y (nn.Linear's weights), for a backend that fuses across
    # its two Linears; None: the model runs the two Linears through `linear`
    mlp: Callable[..., torch.Tensor] | None = None
    # in a whole-model Inductor graph, Inductor's own fusion of `linear`'s bias+GELU and of `add_layernorm` ran
    # faster end to end than this backend's kernels (docs/decisions.md): they give way to the reference ops there
    inductor_fuses_elementwise: bool = False


# backends with an LM-head cross-entropy of their own (the triton set's chunked op); the others use the reference's
FUSED_HEAD_BACKENDS = ("triton",)
# logits the chunked cross-entropy computes at once ([chunk_rows, Vp]): read by the op and by the memory planner
LM_HEAD_CHUNK_ELEMENTS = 1 << 28


def lm_head_chunk_rows(n_rows: int, v_padded: int, elements: int = LM_HEAD_CHUNK_ELEMENTS) -> int:
    """Rows of the chunked cross-entropy's chunk: at most `elements` logits, at least one row."""
    return max(1, min(n_rows, elements // v_padded))


def fused_head_runs(backend: str, *, inductor_head: bool, whole_model_graph: bool) -> bool:
    """Whether `backend`'s own LM-head cross-entropy runs rather than the reference one. Where Inductor compiles the
    head with the rest of the model (`inductor_head`), the backend's op stays only in torch.compile's whole-model
    graph (`whole_model_graph`), where it ran faster than Inductor's fused head (docs/decisions.md); DeepCompile's
    graph, where it was never timed, keeps Inductor's."""
    return backend in FUSED_HEAD_BACKENDS and (not inductor_head or whole_model_graph)


REFERENCE_OPS = KernelOps(
    name="none",
    linear=reference.linear,
    add_layernorm=reference.add_layernorm,
    lm_cross_entropy=reference.lm_cross_entropy,
)

# backend name -> factory(whole_mlp, elementwise): the backend's ops, with its whole-MLP op only if whole_mlp (and
# built only then); elementwise False: a backend whose ops give way to Inductor's there (`inductor_fuses_elementwise`)
# need not build its bias+GELU and add+LayerNorm kernels, which get_ops then replaces
Factory = Callable[[bool, bool], KernelOps]
_BACKENDS: dict[str, Factory] = {"none": lambda whole_mlp, elementwise: REFERENCE_OPS}


def register_backend(name: str, factory: Factory) -> None:
    _BACKENDS[name] = factory


def get_ops(backend: str, *, inductor_head: bool = False, inductor_elementwise: bool = False,
            whole_mlp: bool = False) -> KernelOps:
    """The ops of `backend` ("none", "triton", "cuda"); raises KernelUnavailableError if unusable.

    inductor_head: Inductor compiles the LM head with the rest of the model (`--compile-scope model`, DeepCompile):
    the backend's cross-entropy is kept where `fused_head_runs` says, else the reference one, which Inductor fuses.

    inductor_elementwise: torch.compile traces the whole model as one graph (`--compile-scope model`; DeepCompile's
    graph is not measured): the reference bias+GELU and add+LayerNorm are used where the backend says Inductor fuses
    them faster there (`KernelOps.inductor_fuses_elementwise`).

    whole_mlp: a backend's whole-MLP op may be used (`gpt2.config.layout.whole_mlp_allowed` decides); otherwise
    `mlp` is None and nothing is built for it.
    """
    if backend not in _BACKENDS:
        raise KernelUnavailableError(
            f"fused-kernel backend {backend!r} is not available in this version; "
            f"choose one of {sorted(_BACKENDS)}")
    ops = _BACKENDS[backend](whole_mlp, not inductor_elementwise)
    assert whole_mlp or ops.mlp is None, f"backend {backend!r} returned a whole-MLP op it was not asked for"
    # a backend told its elementwise ops will not run may have skipped building them: they must give way here
    assert not inductor_elementwise or ops.inductor_fuses_elementwise or ops.linear is reference.linear, (
        f"backend {backend!r} keeps elementwise ops it was told would not run")
    if inductor_elementwise and ops.inductor_fuses_elementwise:
        ops = replace(ops, linear=reference.linear, add_layernorm=reference.add_layernorm)
    assert (ops.lm_cross_entropy is not reference.lm_cross_entropy) == (backend in FUSED_HEAD_BACKENDS), (
        f"backend {backend!r}: FUSED_HEAD_BACKENDS disagrees with its lm_cross_entropy")
    if fused_head_runs(backend, inductor_head=inductor_head, whole_model_graph=inductor_elementwise):
        return ops
    return replace(ops, lm_cross_entropy=reference.lm_cross_entropy)


def _lazy_backend(module: str, factory: str) -> Factory:
    """A factory that imports its backend only when asked for: importing the registry never imports
    Triton or builds CUDA code."""

    def load(whole_mlp: bool, elementwise: bool) -> KernelOps:
        try:
            backend = importlib.import_module(module)
        except ImportError as e:
            raise KernelUnavailableError(f"{module} cannot be imported here ({e}); use --fused-kernels none") from e
        return getattr(backend, factory)(whole_mlp=whole_mlp, elementwise=elementwise)

    return load


register_backend("triton", _lazy_backend("fused_kernels.triton", "triton_ops"))
register_backend("cuda", _lazy_backend("fused_kernels.cuda", "cuda_ops"))
