"""Fused kernels against PyTorch eager and torch.compile: time, speed-up, bandwidth/FLOP rate, memory.

    python -m benchmarks.kernels --out benchmarks/results            # all kernels, all shapes (GPU)
    python -m benchmarks.kernels --kernels bias_gelu,layernorm --no-compile

Shapes are [B, T, C] activations: small [4,512,1024], medium [8,512,2048], GPT-2 Large [8,1024,5120]
and the GPT-2 Large training shapes (d = 1280: LayerNorm [8,1024,1280], MLP up-projection
8192x1280 . 1280x5120, LM head 8192x1280 . 1280x50304). For matmul+bias+GELU, C is the output width
and K = C/4 (the d -> 4d up-projection); for cross-entropy, rows = B*T and d = C/4 (vocab 50257, padded
to 50304). All in bf16.

Timing: `ms` is device time: the summed durations of the GPU kernels one call launches (torch.profiler,
L2 flushed before each call, the flush's own kernels subtracted), averaged over PROFILE_ITERS calls.
`wall_ms` is triton.testing.do_bench's median (CUDA events around each call): it also counts host time
whenever the host cannot keep ahead, which for small shapes and fwd+bwd (autograd, Python launches,
torch.compile's AOT wrapper) is most of it; in training the host runs ahead, so speed-ups use `ms`.
"fwd" runs under torch.no_grad() (inference: nothing saved for backward); "fwd+bwd" is a training step
of the op (forward with grad, then backward). GB/s counts the bytes the op must move at least (each input read
once, each output written once) and is compared with this device's measured copy bandwidth (a large
device-to-device copy, read + write); TFLOP/s is compared with its measured bf16 matmul rate
(8192^3). peak_mem_MiB is torch.cuda.max_memory_allocated during one fwd+bwd, above the inputs.
Every row runs in its own try/except: a failure is recorded in the row's `error` column.

Anchors besides eager and torch.compile: Liger-Kernel (the liger-kernel package, where it imports), on the same
functions: `liger` = its fused linear cross-entropy (`liger_fused_linear_cross_entropy`, on the real vocabulary rows
of the padded weight, with token accuracy as ours counts correct predictions; `liger-fp32acc` with
accum_dtype=fp32, the gradient accumulation ours does) and its LayerNorm after an eager residual add. Liger has no
(bias+)GELU or matmul+GELU kernel (its GELU is the gated GEGLU); the bias_gelu `liger` row says so.
Results: kernels.csv and kernels.md in --out (the targets, then where ours lose: every kernel, shape and pass where
the faster of ours is slower than the fastest anchor, or needs more fwd+bwd memory); the table is printed at the end.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.measure import peak_alloc_mib
from fused_kernels import reference
from tools.common import device_tag, markdown_table, tag_line, write_csv

SHAPES = {
    "small": (4, 512, 1024),
    "medium": (8, 512, 2048),
    "gpt2-large": (8, 1024, 5120),
}
GPT2_LARGE_TRAIN = {  # kernel -> the [B, T, C] it sees when training GPT-2 Large (d = 1280) at batch 8 x 1024
    "bias_gelu": (8, 1024, 5120),
    "layernorm": (8, 1024, 1280),
    "matmul_gelu": (8, 1024, 5120),
    "cross_entropy": (8, 1024, 5120),
}
VOCAB, VOCAB_PADDED = 50257, 50304
DTYPE = torch.bfloat16
PROFILE_ITERS = 10
COLUMNS = ["kernel", "shape", "pass", "impl", "ms", "wall_ms", "speedup", "GB/s", "TFLOP/s", "pct_of_peak",
           "peak_mem_MiB", "max_err", "error"]


@dataclass
class Case:
    """One kernel at one shape: inputs, the implementations, and its work for rates."""

    kernel: str
    shape_name: str
    shape: tuple[int, int, int]
    inputs: list[torch.Tensor]  # differentiable inputs first, then others
    n_grad: int  # how many leading inputs get gradients
    impls: dict[str, Callable[..., object] | Exception]  # an Exception: that backend could not be built
    bytes_fwd: float
    bytes_fwdbwd: float
    flops_fwd: float = 0.0  # > 0: compute-bound, report TFLOP/s instead of GB/s


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _backward(out: object, grads: list[torch.Tensor]) -> None:
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    torch.autograd.backward(outs, grads[: len(outs)])


# Eager references (what training runs with --fused-kernels none) and loaders of the fused versions,
# all with one signature per kernel. Loaders import lazily: a backend that fails becomes an error row.
def _eager_bias_gelu(x, b):
    return F.gelu(x + b, approximate="tanh")


def _eager_layernorm(x, r, w, b):
    return reference.add_layernorm(x, r, w, b, 1e-5)


def _eager_matmul_gelu(x, w, b):
    return reference.linear(x, w, b, gelu=True)


def _eager_cross_entropy(h, w, t):
    return reference.lm_cross_entropy(h, w, t, VOCAB)


def _triton_bias_gelu() -> Callable:
    from fused_kernels.triton.bias_gelu import bias_gelu

    return bias_gelu


def _cuda_bias_gelu() -> Callable:
    from fused_kernels.cuda import bias_gelu, load_extension

    load_extension()
    return bias_gelu


def _triton_layernorm() -> Callable:
    from fused_kernels.triton.layernorm import add_layernorm

    return lambda x, r, w, b: add_layernorm(x, r, w, b, 1e-5)


def _triton_matmul_gelu() -> Callable:
    from fused_kernels.triton.matmul_gelu import linear_gelu

    return linear_gelu


def _cuda_matmul_gelu() -> Callable:
    from fused_kernels import get_ops

    linear = get_ops("cuda").linear
    return lambda x, w, b: linear(x, w, b, True)


def _triton_cross_entropy() -> Callable:
    from fused_kernels.triton.cross_entropy import lm_cross_entropy

    return lambda h, w, t: lm_cross_entropy(h, w, t, VOCAB)


# Liger-Kernel (the liger-kernel package, its Triton kernels) as an anchor, computing the same functions: its fused
# linear cross-entropy on the real vocabulary rows of the padded LM-head weight (padded logits excluded, as ours),
# its LayerNorm after an eager residual add. It has no (bias+)GELU kernel, only gated GEGLU / SwiGLU MLPs.
def _liger_cross_entropy(accum_dtype: torch.dtype | None = None) -> Callable[[], Callable]:
    def load() -> Callable:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger_ce(h, w, t):
            if not torch.is_grad_enabled():  # Liger computes the gradients in forward whenever inputs require them
                h, w = h.detach(), w.detach()
            out = liger_fused_linear_cross_entropy(h, w[:VOCAB], t, accum_dtype=accum_dtype,
                                                   return_token_accuracy=True)
            return out.loss, out.token_accuracy

        return liger_ce

    return load


def _liger_layernorm() -> Callable:
    from liger_kernel.transformers.functional import liger_layer_norm

    def liger_add_layernorm(x, r, w, b):
        s = x + r
        return liger_layer_norm(s, w, b, 1e-5), s

    return liger_add_layernorm


def _liger_bias_gelu() -> Callable:
    raise NotImplementedError("Liger-Kernel has no (bias+)GELU kernel: only the gated GEGLU gelu_tanh(a)*b and SwiGLU")


OURS = ("triton", "cuda")
ANCHORS = ("eager", "torch.compile", "liger", "liger-fp32acc")
KERNELS: dict[str, tuple[Callable, dict[str, Callable[[], Callable]]]] = {
    "bias_gelu": (_eager_bias_gelu, {"triton": _triton_bias_gelu, "cuda": _cuda_bias_gelu, "liger": _liger_bias_gelu}),
    "layernorm": (_eager_layernorm, {"triton": _triton_layernorm, "liger": _liger_layernorm}),
    "matmul_gelu": (_eager_matmul_gelu, {"triton": _triton_matmul_gelu, "cuda": _cuda_matmul_gelu}),
    "cross_entropy": (_eager_cross_entropy, {"triton": _triton_cross_entropy, "liger": _liger_cross_entropy(),
                                             "liger-fp32acc": _liger_cross_entropy(torch.float32)}),
}


def build_case(kernel: str, shape_name: str, shape: tuple[int, int, int], compile_: bool) -> Case:
    B, T, C = shape
    M = B * T
    es = torch.finfo(DTYPE).bits // 8

    def rand(*s, scale=1.0):
        return (torch.randn(*s, device="cuda") * scale).to(DTYPE)

    eager, loaders = KERNELS[kernel]
    impls: dict[str, Callable | Exception] = {"eager": eager}
    if compile_:
        torch._dynamo.reset()  # fresh cache per shape: never hit the recompile limit and fall back to eager
        impls["torch.compile"] = torch.compile(eager, dynamic=False)
    for name, load in loaders.items():
        try:
            impls[name] = load()
        except Exception as e:  # reported in this implementation's rows
            impls[name] = e

    if kernel == "bias_gelu":  # fwd: read x, write y; bwd: read dy, x, write dx
        n = M * C
        return Case(kernel, shape_name, shape, [rand(B, T, C), rand(C)], 2, impls, 2 * n * es, 5 * n * es)
    if kernel == "layernorm":  # fwd: read x, residual, write y, r; bwd: read dy, dr_out, r, write dr
        n = M * C
        ins = [rand(B, T, C), rand(B, T, C), rand(C, scale=0.1) + 1, rand(C, scale=0.1)]
        return Case(kernel, shape_name, shape, ins, 4, impls, 4 * n * es, 8 * n * es)
    if kernel == "matmul_gelu":  # [M, C/4] @ [C/4, C]
        K, N = C // 4, C
        ins = [rand(M, K), rand(N, K, scale=K**-0.5), rand(N, scale=0.1)]
        return Case(kernel, shape_name, shape, ins, 3, impls, 0, 0, flops_fwd=2.0 * M * N * K)
    if kernel == "cross_entropy":  # [M, C/4] @ [C/4, Vp]
        d = C // 4
        ins = [rand(M, d), rand(VOCAB_PADDED, d, scale=d**-0.5), torch.randint(0, VOCAB, (M,), device="cuda")]
        return Case(kernel, shape_name, shape, ins, 2, impls, 0, 0, flops_fwd=2.0 * M * d * VOCAB_PADDED)
    raise ValueError(f"unknown kernel {kernel}")


def measure_device() -> dict[str, float]:
    """This device's copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s)."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_gbs = 2 * src.numel() / ms / 1e6
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=DTYPE) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    return {"copy_GB/s": copy_gbs, "matmul_TFLOP/s": 2 * 8192**3 / ms / 1e9}


def run_case(case: Case, peaks: dict[str, float]) -> list[dict[str, object]]:
    rows = []
    eager_ms: dict[str, float] = {}
    with torch.no_grad():
        expected = _first(case.impls["eager"](*case.inputs)).float()
    for impl, fn in case.impls.items():
        for pass_ in ("fwd", "fwd+bwd"):
            row: dict[str, object] = {"kernel": case.kernel, "shape": f"{case.shape_name} {list(case.shape)}",
                                      "pass": pass_, "impl": impl}
            rows.append(row)
            try:
                if isinstance(fn, Exception):
                    raise fn
                row.update(_measure(case, fn, pass_, expected, peaks))
                if impl == "eager":
                    eager_ms[pass_] = row["ms"]
                if pass_ in eager_ms:
                    row["speedup"] = round(eager_ms[pass_] / row["ms"], 2)
            except Exception as e:  # record and go on with the next row
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            torch.cuda.empty_cache()
    return rows


def _kernel_us(fn: Callable[[], object], iters: int) -> float:
    """Summed duration (us) of every GPU kernel / memcpy / memset that `iters` calls of fn launch."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)


def device_ms(fn: Callable[[], object], iters: int = PROFILE_ITERS) -> float:
    """Device time of one call of fn with a cold L2, in ms (see the module docstring)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than any L2

    def flushed() -> None:
        flush.zero_()
        fn()

    for _ in range(3):  # warm-up: autotuning, compilation, allocator
        flushed()
    return (_kernel_us(flushed, iters) - _kernel_us(flush.zero_, iters)) / iters / 1e3


def _measure(case: Case, fn: Callable, pass_: str, expected: torch.Tensor, peaks: dict[str, float]) -> dict:
    import triton.testing

    leaves = [t.detach().requires_grad_(i < case.n_grad) for i, t in enumerate(case.inputs)]
    out: dict[str, object] = {}
    if pass_ == "fwd":
        with torch.no_grad():
            got = _first(fn(*leaves)).float()
            out["max_err"] = f"{(got - expected).abs().max().item():.2e}"
            wall = triton.testing.do_bench(lambda: fn(*leaves), return_mode="median")
            ms = device_ms(lambda: fn(*leaves))
        work_bytes, flops = case.bytes_fwd, case.flops_fwd
    else:
        sample = fn(*leaves)
        grads = [torch.randn_like(o) if o.is_floating_point() and o.dim() > 0 else torch.ones_like(o)
                 for o in (sample if isinstance(sample, tuple) else (sample,)) if o.requires_grad]
        del sample
        grad_leaves = leaves[: case.n_grad]

        def step():
            _backward(fn(*leaves), grads)

        def fresh_step():  # gradients start at None every call, as after zero_grad(set_to_none=True)
            for t in grad_leaves:
                t.grad = None
            step()

        wall = triton.testing.do_bench(step, grad_to_none=grad_leaves, return_mode="median")
        ms = device_ms(fresh_step)
        for t in grad_leaves:
            t.grad = None
        out["peak_mem_MiB"] = peak_alloc_mib(step)
        for t in grad_leaves:
            t.grad = None
        work_bytes, flops = case.bytes_fwdbwd, 3 * case.flops_fwd
    out["ms"] = round(ms, 4)
    out["wall_ms"] = round(wall, 4)
    if flops:
        tflops = flops / ms / 1e9
        out["TFLOP/s"] = round(tflops, 1)
        out["pct_of_peak"] = round(100 * tflops / peaks["matmul_TFLOP/s"], 1)
    else:
        gbs = work_bytes / ms / 1e6
        out["GB/s"] = round(gbs, 1)
        out["pct_of_peak"] = round(100 * gbs / peaks["copy_GB/s"], 1)
    return out


def targets(rows: list[dict[str, object]]) -> list[str]:
    """The issue's performance targets, each checked against the measured rows."""

    def find(kernel: str, shape: tuple[int, int, int], pass_: str, impl: str) -> dict[str, object] | None:
        for r in rows:
            if r["kernel"] == kernel and str(list(shape)) in str(r["shape"]) and r["pass"] == pass_ \
                    and r["impl"] == impl and "ms" in r:
                return r
        return None

    lines = []

    def check(label: str, row: dict | None, key: str, ok: Callable[[float], bool], fmt: str) -> None:
        if row is None or key not in row:
            lines.append(f"- {label}: not measured")
        else:
            v = float(row[key])
            lines.append(f"- {label}: {fmt.format(v)} -> {'MET' if ok(v) else 'NOT MET'}")

    big = GPT2_LARGE_TRAIN
    for impl in ("triton", "cuda"):
        check(f"bias+GELU fwd ({impl}, {big['bias_gelu']}) >= 85% of copy bandwidth",
              find("bias_gelu", big["bias_gelu"], "fwd", impl), "pct_of_peak", lambda v: v >= 85, "{:.1f}%")
    check(f"add+LayerNorm fwd+bwd (triton, {big['layernorm']}) >= 1.5x eager",
          find("layernorm", big["layernorm"], "fwd+bwd", "triton"), "speedup", lambda v: v >= 1.5, "{:.2f}x")
    for pass_ in ("fwd", "fwd+bwd"):
        check(f"matmul+bias+GELU {pass_} (triton, 8192x1280 . 1280x5120) >= 1.15x cuBLAS linear + GELU",
              find("matmul_gelu", big["matmul_gelu"], pass_, "triton"), "speedup", lambda v: v >= 1.15, "{:.2f}x")
    eager = find("cross_entropy", big["cross_entropy"], "fwd+bwd", "eager")
    ours = find("cross_entropy", big["cross_entropy"], "fwd+bwd", "triton")
    if eager and ours and "peak_mem_MiB" in eager and "peak_mem_MiB" in ours:
        ratio = float(ours["peak_mem_MiB"]) / float(eager["peak_mem_MiB"])
        lines.append(f"- cross-entropy peak memory (8x1024, vocab {VOCAB_PADDED}) <= 1/4 of eager: "
                     f"{ours['peak_mem_MiB']} vs {eager['peak_mem_MiB']} MiB = {ratio:.3f} -> "
                     f"{'MET' if ratio <= 0.25 else 'NOT MET'}")
    else:
        lines.append("- cross-entropy peak memory: not measured")
    return lines


def where_ours_lose(rows: list[dict[str, object]]) -> list[str]:
    """Each kernel, shape and pass where the faster of ours (triton, cuda) is slower than the fastest anchor
    (eager, torch.compile, Liger), or where our leanest fwd+bwd peak memory exceeds the anchors' leanest."""
    groups: dict[tuple[object, object, object], list[dict[str, object]]] = {}
    for r in rows:
        if "ms" in r:
            groups.setdefault((r["kernel"], r["shape"], r["pass"]), []).append(r)
    lines = []
    for (kernel, shape, pass_), group in groups.items():
        ours = [r for r in group if r["impl"] in OURS]
        anchors = [r for r in group if r["impl"] in ANCHORS]
        if not ours or not anchors:
            continue
        mine = min(ours, key=lambda r: float(r["ms"]))
        best = min(anchors, key=lambda r: float(r["ms"]))
        if float(mine["ms"]) > float(best["ms"]):
            lines.append(f"- {kernel} {shape} {pass_}: time: ours ({mine['impl']}) {mine['ms']} ms vs {best['impl']} "
                         f"{best['ms']} ms ({float(mine['ms']) / float(best['ms']):.2f}x slower)")
        ours_mem = [r for r in ours if "peak_mem_MiB" in r]
        anchor_mem = [r for r in anchors if "peak_mem_MiB" in r]
        if ours_mem and anchor_mem:
            mine = min(ours_mem, key=lambda r: float(r["peak_mem_MiB"]))
            best = min(anchor_mem, key=lambda r: float(r["peak_mem_MiB"]))
            if float(mine["peak_mem_MiB"]) > float(best["peak_mem_MiB"]):
                lines.append(f"- {kernel} {shape} {pass_}: memory: ours ({mine['impl']}) {mine['peak_mem_MiB']} MiB "
                             f"vs {best['impl']} {best['peak_mem_MiB']} MiB")
    return lines or ["- nowhere among the measured rows"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--kernels", default="bias_gelu,layernorm,matmul_gelu,cross_entropy")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--quick", action="store_true",
                   help="only the GPT-2 Large training shape of each kernel (the one the targets are checked on)")
    p.add_argument("--compile-budget-s", type=float, default=240.0,
                   help="stop adding torch.compile rows once the run has taken this long")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels needs a CUDA GPU")

    start = time.monotonic()
    tag = device_tag("cuda")
    peaks = measure_device()
    print(f"{tag_line(tag)}: copy {peaks['copy_GB/s']:.0f} GB/s, bf16 matmul {peaks['matmul_TFLOP/s']:.0f} TFLOP/s",
          flush=True)
    out_dir = Path(args.out)
    rows: list[dict[str, object]] = []
    for kernel in args.kernels.split(","):
        shapes = {} if args.quick else dict(SHAPES)
        if GPT2_LARGE_TRAIN[kernel] not in shapes.values():
            shapes["gpt2-large-train"] = GPT2_LARGE_TRAIN[kernel]
        for shape_name, shape in shapes.items():
            compile_ = not args.no_compile and time.monotonic() - start < args.compile_budget_s
            try:
                case = build_case(kernel, shape_name, shape, compile_)
                new = run_case(case, peaks)
                del case
            except Exception as e:  # the inputs themselves failed (e.g. out of memory)
                new = [{"kernel": kernel, "shape": f"{shape_name} {list(shape)}", "error": f"{type(e).__name__}: {e}"}]
            rows += new
            for r in new:
                print(" | ".join(str(r.get(c, "")) for c in COLUMNS), flush=True)
            write_csv(out_dir / "kernels.csv", rows, tag)  # after every shape: a timeout keeps what was measured
            torch.cuda.empty_cache()

    header = (f"# Fused kernels vs PyTorch ({tag_line(tag)}, triton {tag['triton']})\n\n"
              f"Measured here: device-to-device copy {peaks['copy_GB/s']:.0f} GB/s (read + write), "
              f"bf16 matmul 8192^3 {peaks['matmul_TFLOP/s']:.0f} TFLOP/s. pct_of_peak is relative to these.\n\n")
    table = markdown_table(rows, COLUMNS)
    summary = "\n".join(["", "## Targets", *targets(rows), "",
                          "## Where ours lose (to eager, torch.compile or Liger-Kernel; device time, fwd+bwd memory)",
                          *where_ours_lose(rows)])
    (out_dir / "kernels.md").write_text(header + table + "\n" + summary + "\n")
    print("\n" + header + table + "\n" + summary)


if __name__ == "__main__":
    main()
