"""Attention functions for `--attn`, with the `gpt2.model.gpt.AttentionFn` signature:
(q, k, v [B, H, T, hd], dropout_p) -> [B, H, T, hd], causal.

    sdpa            F.scaled_dot_product_attention; PyTorch picks among its flash / cuDNN / memory-efficient /
                    math kernels by its own priority order (the first whose constraints the inputs meet)
    sdpa-flash      SDPA restricted to one kernel (`torch.nn.attention.sdpa_kernel`): an error where that kernel
    sdpa-cudnn        cannot take the inputs, never a silent fallback. cuDNN and memory-efficient need CUDA;
    sdpa-efficient    flash and math also run on CPU (PyTorch has a CPU flash kernel)
    sdpa-math
    auto            on CUDA, the fastest of sdpa-flash / sdpa-cudnn / sdpa-efficient at the run's shape whose
                    output and gradients match an fp64 math reference (`choose_sdpa_backend`); on CPU: sdpa
    flash           the flash-attn package (Dao et al.); a clear error where it is not installed

`resolve_attention(name, shape)` returns an `AttentionChoice`: the function and what it runs (`backend`, e.g.
"sdpa-cudnn"), which the run summary records. The kernel restriction is a `sdpa_kernel` context inside the
function, which Dynamo traces (it sets the backend flags while the graph is traced, so the compiled graph holds
that kernel's op), so the choice made once at model build also holds under `torch.compile`.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fused_kernels import KernelUnavailableError

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

SDPA_BACKENDS: dict[str, SDPBackend] = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-math": SDPBackend.MATH,
}
ATTN_CHOICES = ("sdpa", "auto", *SDPA_BACKENDS, "flash")
CUDA_ONLY = frozenset({"sdpa-cudnn", "sdpa-efficient"})
AUTO_CANDIDATES = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")  # math: never faster, the fallback
# `auto` accepts a kernel whose output and q/k/v gradients, on a probe, differ from an fp64 math reference by at
# most this times the reference's largest magnitude (max |got - ref| / max |ref|, per tensor). On CPU the flash
# and math kernels make 3e-3..8e-3 in bf16, 3e-4..1e-3 in fp16, < 1e-6 in fp32; a wrong kernel (e.g. without the
# causal mask) makes ~1.
AUTO_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-3}
PROBE_MAX_SEQ = 512  # the accuracy probe: [1, H, min(T, 512), hd]
AUTO_WARMUP, AUTO_ITERS = 2, 5  # timing of each candidate: fwd+bwd at the run's shape, median of AUTO_ITERS


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal SDPA; PyTorch picks the kernel. q, k, v: [B, H, T, hd] -> [B, H, T, hd]."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def make_sdpa_backend_attention(backend: SDPBackend) -> AttentionFn:
    """Causal SDPA that runs only `backend` (an error, not a fallback, where it cannot take the inputs)."""

    def sdpa_one_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    return sdpa_one_backend


def _flash_attn_func() -> Callable[..., torch.Tensor]:
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        raise KernelUnavailableError(
            "--attn flash needs the flash-attn package (pip install flash-attn --no-build-isolation, on a CUDA "
            f"machine); use --attn sdpa, which can pick PyTorch's own flash kernel ({e})") from e
    return flash_attn_func


def make_flash_attention() -> AttentionFn:
    """flash_attn_func wrapped to the [B, H, T, hd] layout; raises KernelUnavailableError without flash-attn."""
    flash_attn_func = _flash_attn_func()

    def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        # flash-attn takes [B, T, H, hd] and fp16/bf16 CUDA tensors
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, T, H, hd]
        out = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)  # [B, T, H, hd]
        return out.transpose(1, 2)  # [B, H, T, hd]

    return flash_attention


@dataclass(frozen=True)
class AttentionShape:
    """What one rank's attention sees in training: [batch, heads, seq_len, head_dim] (heads = n_head / tp), the
    dtype q/k/v arrive in (the autocast dtype, or fp32) and the training dropout."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    dropout_p: float = 0.0

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return self.batch, self.heads, self.seq_len, self.head_dim


@dataclass
class AttentionChoice:
    """The attention function of a run and what it runs: `backend` is a `--attn` name ("sdpa-cudnn", ...) or
    "flash-attn"; for `--attn sdpa`, the kernel PyTorch picks (probed) where a shape was given, else "sdpa"."""

    name: str  # the --attn value
    backend: str
    fn: AttentionFn
    timings_ms: dict[str, float] = field(default_factory=dict)  # auto: fwd+bwd ms of each accepted candidate
    rejected: dict[str, str] = field(default_factory=dict)  # auto: candidate -> why it was not timed

    def with_backend(self, backend: str) -> AttentionChoice:
        """This choice running `backend` instead (an SDPA_BACKENDS name or "sdpa"): rank 0's pick on every rank."""
        if backend == self.backend:
            return self
        fn = make_sdpa_backend_attention(SDPA_BACKENDS[backend]) if backend in SDPA_BACKENDS else sdpa_attention
        return AttentionChoice(self.name, backend, fn, self.timings_ms, self.rejected)

    def describe(self) -> str:
        """One line for the log and the summary, e.g. `auto -> sdpa-cudnn (sdpa-cudnn <t> ms; sdpa-flash <t> ms;
        rejected sdpa-efficient: ...)`."""
        if self.name == self.backend:
            return self.name
        text = f"{self.name} -> {self.backend}"
        details = [f"{n} {ms:.3f} ms" for n, ms in sorted(self.timings_ms.items(), key=lambda item: item[1])]
        details += [f"rejected {n}: {why}" for n, why in self.rejected.items()]
        return text + (f" ({'; '.join(details)})" if details else "")


def first_line(err: BaseException) -> str:
    """`Type: first line of the message` (200 characters at most), for a rejected kernel's reason."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _sdpa_backend_name(backend: SDPBackend) -> str:
    return next(name for name, b in SDPA_BACKENDS.items() if b == backend)


def fwd_bwd(fn: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
             dropout_p: float) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of one forward + backward of fn (q, k, v are detached leaves here)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a refusing SDPA kernel warns why before it raises
        out = fn(q, k, v, dropout_p)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def probe_error(fn: AttentionFn, shape: AttentionShape, seed: int = 0) -> float:
    """The largest of max |got - ref| / max |ref| over the output and the q/k/v gradients of fn, against fp64
    math SDPA, on [1, heads, min(T, PROBE_MAX_SEQ), hd] inputs of shape.dtype (no dropout).
    Raises RuntimeError where fn cannot run these inputs."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dims = (1, shape.heads, min(shape.seq_len, PROBE_MAX_SEQ), shape.head_dim)
    q, k, v, dout = (torch.randn(dims, generator=gen, dtype=torch.float64).to(shape.device) for _ in range(4))
    ref = fwd_bwd(make_sdpa_backend_attention(SDPBackend.MATH), q, k, v, dout, 0.0)
    got = fwd_bwd(fn, *(t.to(shape.dtype) for t in (q, k, v, dout)), 0.0)
    return max(((g.double() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref, strict=True))


def time_fwd_bwd_ms(fn: AttentionFn, shape: AttentionShape, warmup: int = AUTO_WARMUP,
                    iters: int = AUTO_ITERS) -> float:
    """Median ms of one forward + backward of fn at shape (CUDA events; perf_counter on CPU). The warm-up calls
    also show that fn takes these inputs with the training dropout and without (eval): RuntimeError if not."""
    q, k, v, dout = (torch.randn(shape.dims, device=shape.device, dtype=shape.dtype) for _ in range(4))
    if shape.dropout_p:
        fwd_bwd(fn, q, k, v, dout, 0.0)  # evaluation runs the same kernel without dropout
    for _ in range(warmup):
        fwd_bwd(fn, q, k, v, dout, shape.dropout_p)
    times = []
    for _ in range(iters):
        if shape.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fwd_bwd(fn, q, k, v, dout, shape.dropout_p)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fwd_bwd(fn, q, k, v, dout, shape.dropout_p)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


Timer = Callable[[AttentionFn, AttentionShape], float]


def choose_sdpa_backend(shape: AttentionShape, candidates: Iterable[str] = AUTO_CANDIDATES,
                        timer: Timer = time_fwd_bwd_ms,
                        error: Callable[[AttentionFn, AttentionShape], float] = probe_error) -> AttentionChoice:
    """`--attn auto`: of `candidates` (names in SDPA_BACKENDS), the one with the shortest `timer` (fwd+bwd at the
    run's shape) among those that run at this shape, dtype and dropout and whose `error` (against fp64 math on a
    probe) is within AUTO_TOLERANCE[dtype]. None accepted: plain sdpa (PyTorch picks, math at worst).
    `timer` and `error` are injectable for tests."""
    tolerance = AUTO_TOLERANCE.get(shape.dtype, AUTO_TOLERANCE[torch.float32])
    timings: dict[str, float] = {}
    rejected: dict[str, str] = {}
    for name in candidates:
        fn = make_sdpa_backend_attention(SDPA_BACKENDS[name])
        try:
            err = error(fn, shape)
            if not err <= tolerance:  # also NaN
                rejected[name] = f"max error {err:.2e} > {tolerance:.0e}"
                continue
            timings[name] = timer(fn, shape)
        except RuntimeError as e:  # the kernel does not take this dtype / head size / dropout / device
            rejected[name] = first_line(e)
    if shape.device.type == "cuda":
        torch.cuda.empty_cache()
    if not timings:
        return AttentionChoice("auto", "sdpa", sdpa_attention, timings, rejected)
    best = min(timings, key=lambda n: timings[n])
    return AttentionChoice("auto", best, make_sdpa_backend_attention(SDPA_BACKENDS[best]), timings, rejected)


def check_device(name: str, device_type: str) -> None:
    """KernelUnavailableError, naming the fix, where `--attn name` forces a kernel that needs CUDA on another device."""
    if name in CUDA_ONLY and device_type != "cuda":
        raise KernelUnavailableError(f"--attn {name} needs a CUDA GPU; use --attn auto or sdpa")


def resolve_attention(name: str, shape: AttentionShape | None = None) -> AttentionChoice:
    """The attention of `--attn name` for a run whose attention sees `shape` (None: no probing; then `auto` is
    plain sdpa and a forced kernel is only checked against the device, if any).

    Raises KernelUnavailableError for an unknown name, flash without flash-attn, or a forced SDPA kernel that
    cannot run here (the message is PyTorch's reason)."""
    if name not in ATTN_CHOICES:
        raise KernelUnavailableError(f"unknown attention {name!r}; choose one of {', '.join(ATTN_CHOICES)}")
    if name == "flash":
        return AttentionChoice(name, "flash-attn", make_flash_attention())
    if name == "sdpa":
        backend = "sdpa"
        if shape is not None:
            used = sdpa_backend_used(shape.dims, shape.dtype, shape.device, shape.dropout_p)
            backend = _sdpa_backend_name(getattr(SDPBackend, used))
        return AttentionChoice(name, backend, sdpa_attention)
    if name == "auto":
        if shape is None or shape.device.type != "cuda":
            return AttentionChoice(name, "sdpa", sdpa_attention)
        return choose_sdpa_backend(shape)
    fn = make_sdpa_backend_attention(SDPA_BACKENDS[name])
    if shape is not None:
        check_device(name, shape.device.type)
        try:
            small = AttentionShape(1, 1, shape.seq_len, shape.head_dim, shape.dtype, shape.device, shape.dropout_p)
            for dropout_p in {0.0, shape.dropout_p}:
                fwd_bwd(fn, *(torch.randn(small.dims, device=small.device, dtype=small.dtype) for _ in range(4)),
                         dropout_p)
        except RuntimeError as e:
            raise KernelUnavailableError(
                f"--attn {name} cannot run {shape.dtype} attention of head size {shape.head_dim}, "
                f"seq len {shape.seq_len}, dropout {shape.dropout_p} on {shape.device}: {first_line(e)}; "
                "use --attn auto or sdpa") from e
    return AttentionChoice(name, name, fn)


def get_attention(name: str) -> AttentionFn:
    """The attention function for `--attn name`, without probing (see `resolve_attention`)."""
    return resolve_attention(name).fn


def sdpa_backend_used(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | str, dropout_p: float = 0.0,
    requires_grad: bool = True,
) -> str:
    """Which SDPA kernel PyTorch runs for causal attention on [B, H, T, hd] inputs of this dtype/device: the
    answer of its own dispatcher (`torch._fused_sdp_choice`, what F.scaled_dot_product_attention calls), e.g.
    "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION" or "MATH".

    Not a walk over `torch._C._get_sdp_priority_order()`: PyTorch sets its own order lazily, at the first
    dispatch (on Hopper, torch 2.11 moves cuDNN first), so a walk made before any attention call named flash for
    training runs whose profiles show cuDNN's kernels. The inputs are allocated uninitialised at the full shape:
    constraints may depend on batch and heads. Raises RuntimeError where no backend accepts the inputs.
    """
    q = torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)  # [B, H, T, hd]
    return SDPBackend(torch._fused_sdp_choice(q, q, q, None, dropout_p, True)).name
