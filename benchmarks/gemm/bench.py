"""GEMM ladder benchmark: our CUDA kernels and a Triton matmul against cuBLAS (torch.matmul), bf16.

    python -m benchmarks.gemm.bench --out benchmarks/results [--quick] [--time-budget-s 300]
        [--kernels cublas,wgmma,wgmma_persistent] [--shapes 4096,gpt2,tail] [--bias-gelu]

Order: 4096^3 first (the target: best hand-written CUDA kernel >= 70% of cuBLAS), then square
sizes 512..8192, then GPT-2 Large's training GEMMs (8192 tokens, d=1280; forward, dgrad, wgrad),
until the time budget is spent (--shapes picks groups of them, --kernels a subset of the kernels; only the
extensions those kernels need are built). On a Hopper GPU (compute capability 9.0) the ladder gains `wgmma`
(gemm_wgmma.cu: wgmma.mma_async + TMA) and `wgmma_persistent` (gemm_wgmma_persistent.cu: the same mainloop,
persistent CTAs, epilogue through shared memory and TMA stores), built as a second extension for sm_90a only.
Those two, the binding and the header are the library's sources (fused_kernels/cuda/: training's fused MLP runs
on them); this folder keeps the ladder's steps 1-5 (gemm_kernels.cu).
--bias-gelu adds the MLP up-projection with bias + GELU(tanh) fused into wgmma_persistent's epilogue against
cuBLAS + a separate bias-GELU (gemm_bias_gelu.csv), and its training step, forward + backward, fused (pre-activation
written by the forward epilogue, GELU backward + bias gradient in the dgrad's) against eager (gemm_mlp_fwd_bwd.csv).
Every (kernel, shape) is first checked against an fp64 reference on fresh random inputs, with the output
poisoned with NaN: relative Frobenius error <= 1e-2 (bf16 output rounding alone gives ~2e-3) or it is reported
FAIL and not timed. Each hand-written kernel is first run alone in a subprocess on a small shape, so one that
crashes the CUDA context is reported and dropped instead of taking the others down. Timing: median over CUDA-event
pairs, each around a burst of back-to-back calls (so host-side launch overhead overlaps the GPU work, as in a
training step). Writes gemm.csv, gemm_roofline.png and gemm_summary.md; ceilings are measured here: copy
bandwidth (device-to-device copy) and the best cuBLAS rate.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.measure import median_ms, time_ms
from fused_kernels.cuda.mlp import SOURCE_DIR as CUDA_DIR
from fused_kernels.cuda.mlp import hopper, load_wgmma_extension
from tools.common import device_tag, markdown_table, tag_line, write_csv

HERE = Path(__file__).resolve().parent  # the ladder's steps 1-5 (gemm_kernels.cu); the wgmma kernels, the binding and
# the header are the library's (fused_kernels/cuda/, CUDA_DIR), which training builds from too
CUDA_KERNELS = ["naive", "smem", "regblock", "wmma", "mma_128x128", "mma_128x256"]
HOPPER_KERNELS = ["wgmma", "wgmma_persistent"]  # sm_90a only: fused_kernels/cuda/gemm_wgmma*.cu, own extension
PERSISTENT_KERNELS = {"wgmma_persistent"}  # probed on a shape with more tiles than SMs
# wgmma_persistent with fused epilogues (same extension): MLP up-projection forward, forward + AUX, backward
FUSED_EPILOGUES = ["wgmma_persistent_bias_gelu", "wgmma_persistent_bias_gelu_aux", "wgmma_persistent_dgelu"]
SLOW_KERNELS = {"naive", "smem"}  # timed only up to SLOW_MAX_FLOPS: 8192^3 naive takes seconds per call
SLOW_MAX_FLOPS = 2 * 4096**3
TOLERANCE = 1e-2
TARGET = 0.70
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


@dataclass(frozen=True)
class Shape:
    name: str
    M: int
    N: int
    K: int

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K

    @property
    def intensity(self) -> float:
        """FLOP per byte of the minimum traffic: read A and B, write C, bf16."""
        return self.flops / (2 * (self.M * self.K + self.K * self.N + self.M * self.N))


def gpt2_large_shapes(tokens: int = 8192, d: int = 1280, vocab: int = 50304) -> list[Shape]:
    """y = x W^T with x [tokens, d_in]: fwd M=tokens,K=d_in,N=d_out; dgrad M=tokens,K=d_out,N=d_in;
    wgrad (dW = dy^T x) M=d_out,K=tokens,N=d_in."""
    layers = {"qkv": (d, 3 * d), "attn_out": (d, d), "mlp_up": (d, 4 * d), "mlp_down": (4 * d, d),
              "lm_head": (d, vocab)}
    shapes = []
    for name, (d_in, d_out) in layers.items():
        shapes += [Shape(f"{name}.fwd", tokens, d_out, d_in), Shape(f"{name}.dgrad", tokens, d_in, d_out),
                   Shape(f"{name}.wgrad", d_out, d_in, tokens)]
    return shapes


SHAPE_GROUPS = ("4096", "squares", "gpt2", "tail")
# Off the 128x256x64 tile in M, N and K (only wgmma_persistent takes it: TMA zero-fills and clips), more tiles
# than SMs, and N's last tile has epilogue chunks wholly outside C.
TAIL_SHAPE = Shape("tail", 2000, 4104, 328)


def all_shapes(quick: bool, groups: tuple[str, ...] = ("4096", "squares", "gpt2")) -> list[Shape]:
    """The shapes of the selected groups, in this order: 4096^3, the other squares, GPT-2 Large's training
    GEMMs (forward only with quick), the tail shape."""
    squares = [512, 1024, 2048, 8192] if not quick else [1024, 2048, 8192]
    gpt = gpt2_large_shapes()
    if quick:
        gpt = [s for s in gpt if s.name.endswith(".fwd")]
    shapes = {"4096": [Shape("square", 4096, 4096, 4096)], "squares": [Shape("square", n, n, n) for n in squares],
              "gpt2": gpt, "tail": [TAIL_SHAPE]}
    return [s for g in SHAPE_GROUPS if g in groups for s in shapes[g]]


def cuda_kernels() -> list[str]:
    """The hand-written kernels this device runs: the ladder, plus the sm_90a kernels on Hopper (9.0 only:
    wgmma does not exist on later architectures either)."""
    return CUDA_KERNELS + (HOPPER_KERNELS if hopper() else [])


def build_extension(verbose: bool = False, kernels: list[str] | None = None) -> dict[str, Gemm]:
    """kernel name -> launcher, for the kernels of cuda_kernels() that are in `kernels` (default: all);
    an extension is only built if one of its kernels is wanted. gemm_wgmma*.cu are a second extension:
    load() applies one flag set to every source, and gemm_kernels.cu must keep its sm_80 build while the
    wgmma kernels must be sm_90a only (an 'arch' flag in extra_cuda_cflags replaces torch's own -gencode
    flags). Both bind through fused_kernels/cuda/gemm_binding.cpp; -DGEMM_WGMMA selects the wgmma binding, which
    also exports FUSED_EPILOGUES: wgmma_persistent_bias_gelu (A, B, bias, C), wgmma_persistent_bias_gelu_aux (A, B,
    bias, C, AUX) and wgmma_persistent_dgelu (A, B, AUX, C, DBIAS)."""
    from torch.utils.cpp_extension import load

    wanted = set(cuda_kernels() if kernels is None else kernels) & set(cuda_kernels())
    cuda_flags = ["-O3", "-std=c++17", "-lineinfo"]
    fns: dict[str, Gemm] = {}
    if wanted & set(CUDA_KERNELS):
        ladder = load(name="gemm_ladder", sources=[str(HERE / "gemm_kernels.cu"), str(CUDA_DIR / "gemm_binding.cpp")],
                      extra_cuda_cflags=cuda_flags, extra_cflags=["-O3"], extra_include_paths=[str(CUDA_DIR)],
                      verbose=verbose)
        fns.update({k: getattr(ladder, k) for k in CUDA_KERNELS})
    if wanted & set(HOPPER_KERNELS):  # the build training's fused MLP loads too (one recipe)
        wgmma = load_wgmma_extension(verbose)
        fns.update({k: getattr(wgmma, k) for k in [*HOPPER_KERNELS, *FUSED_EPILOGUES]})
    return fns


def relative_error(C: torch.Tensor, ref: torch.Tensor) -> float:
    return ((C.double() - ref).norm() / ref.norm()).item()


def fresh_inputs(shape: Shape, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    A = torch.randn(shape.M, shape.K, device="cuda", generator=g).to(torch.bfloat16)
    B = torch.randn(shape.K, shape.N, device="cuda", generator=g).to(torch.bfloat16)
    ref = A.double() @ B.double()
    return A, B, ref


def check(fn: Gemm, shape: Shape, seed: int) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    A, B, ref = fresh_inputs(shape, seed)
    C = torch.full((shape.M, shape.N), float("nan"), device="cuda", dtype=torch.bfloat16)
    fn(A, B, C)
    torch.cuda.synchronize()
    return relative_error(C, ref), A, B, C


def probe(kernel: str) -> int:
    """Run one kernel alone on a small odd-ish shape; exit status 0 iff correct (crashes are non-zero).
    K = 320 is a multiple of every tiled kernel's BK and runs more k-tiles than any pipeline has stages; a
    persistent kernel gets 256 tiles (more than any GPU has SMs), so its CTAs run several tiles each."""
    ext = build_extension(kernels=[kernel])
    shape = Shape("probe", 200, 300, 100) if kernel in SLOW_KERNELS else Shape("probe", 256, 512, 320)
    if kernel in PERSISTENT_KERNELS:
        shape = Shape("probe", 2048, 4096, 320)
    err, *_ = check(ext[kernel], shape, seed=0)
    print(f"probe {kernel}: rel err {err:.2e}")
    return 0 if err <= TOLERANCE else 1


def probe_all(kernels: list[str], timeout_s: float = 300) -> dict[str, str]:
    """kernel -> "ok" or why it is dropped (a hang, e.g. a pipeline waiting forever, costs timeout_s)."""
    status = {}
    for k in kernels:
        try:
            r = subprocess.run([sys.executable, "-m", "benchmarks.gemm.bench", "--probe", k], capture_output=True,
                               text=True, timeout=timeout_s, cwd=HERE.parents[1])
            status[k] = "ok" if r.returncode == 0 else f"probe failed: {(r.stdout + r.stderr).strip()[-200:]}"
        except subprocess.TimeoutExpired:
            status[k] = "probe timed out"
        print(f"probe {k}: {status[k]}", flush=True)
    return status


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=10, device=torch.device("cuda"))
    return 2 * src.numel() * 2 / (ms / 1e3)


def timed_ms(fn: Gemm, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, budget_s: float) -> float:
    return timed_call_ms(lambda: fn(A, B, C), budget_s)


def timed_call_ms(call: Callable[[], object], budget_s: float) -> float:
    """Per-call time: median over CUDA-event pairs, each around a burst of back-to-back calls (about 1 ms of
    GPU work, at most 20 calls) so that the host-side launch cost of one call hides behind the previous one, as
    in a training step; samples sized to about budget_s."""
    first = min(time_ms(call, iters=1, warmup=1, device=torch.device("cuda")))
    burst = int(max(1, min(20, 1.0 / max(first, 1e-3))))
    reps = int(max(3, min(50, budget_s * 1e3 / max(first * burst, 1e-3))))

    def bursts() -> None:
        for _ in range(burst):
            call()

    return median_ms(bursts, iters=reps, warmup=1, device=torch.device("cuda")) / burst


def selected(args: argparse.Namespace) -> list[str]:
    """The kernels to run, in ladder order: --kernels (a comma list; default all) among those this device has."""
    every = ["cublas", *cuda_kernels(), "triton"]
    if args.kernels is None:
        return every
    want = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = set(want) - {"cublas", *CUDA_KERNELS, *HOPPER_KERNELS, "triton"}
    if unknown:
        sys.exit(f"unknown kernels {sorted(unknown)}")
    missing = set(want) - set(every)
    if missing:
        print(f"not available on this device: {sorted(missing)}", flush=True)
    return [k for k in every if k in want]


def run(args: argparse.Namespace, ext: dict[str, Gemm] | None = None,
        t_start: float | None = None) -> tuple[list[dict[str, object]], dict[str, str]]:
    """(rows, kernel -> probe status); with --bias-gelu wgmma_persistent is probed even if not selected."""
    t_start = time.time() if t_start is None else t_start
    order = selected(args)
    names = [k for k in order if k not in ("cublas", "triton")]
    ext = build_extension(verbose=args.verbose, kernels=names) if ext is None else ext
    print(f"built extensions in {time.time() - t_start:.0f} s", flush=True)
    extra = ["wgmma_persistent"] if getattr(args, "bias_gelu", False) and "wgmma_persistent" in ext else []
    probes = probe_all(list(dict.fromkeys([*names, *extra])), args.probe_timeout_s)
    kernels: dict[str, Gemm] = {"cublas": lambda A, B, C: torch.matmul(A, B, out=C)}
    kernels.update({k: ext[k] for k in names if probes[k] == "ok"})
    if "triton" in order:
        from benchmarks.gemm.triton_matmul import triton_matmul

        kernels["triton"] = triton_matmul

    rows: list[dict[str, object]] = []
    for i, shape in enumerate(all_shapes(args.quick, tuple(args.shapes.split(",")))):
        over = time.time() - t_start > args.time_budget_s
        cublas_ms = None
        for name in order:
            row: dict[str, object] = {"kernel": name, "shape": shape.name, "M": shape.M, "N": shape.N, "K": shape.K,
                                      "intensity": round(shape.intensity, 1), "tolerance": TOLERANCE}
            rows.append(row)
            if name not in kernels:
                row["status"] = f"FAIL ({probes.get(name)})"
                continue
            if over:
                row["status"] = "SKIP (time budget)"
                continue
            if name in SLOW_KERNELS and shape.flops > SLOW_MAX_FLOPS:
                row["status"] = "SKIP (slow kernel, large shape)"
                continue
            try:
                err, A, B, C = check(kernels[name], shape, seed=i)
                row["rel_err"] = f"{err:.2e}"
                if not err <= TOLERANCE:  # NaN fails too
                    row["status"] = "FAIL"
                    continue
                ms = timed_ms(kernels[name], A, B, C, args.point_budget_s)
                row.update(status="PASS", time_ms=round(ms, 4), gflops=round(shape.flops / ms / 1e6, 1))
                if name == "cublas":
                    cublas_ms = ms
                if cublas_ms:
                    row["pct_cublas"] = round(100 * cublas_ms / ms, 1)
            except RuntimeError as err:  # unsupported shape or a launch error: record, go on
                row["status"] = f"SKIP ({str(err).splitlines()[0][:100]})"
            finally:
                torch.cuda.empty_cache()
            print({k: row.get(k) for k in ("kernel", "shape", "M", "N", "K", "status", "rel_err", "gflops",
                                           "pct_cublas")}, flush=True)
    return rows, probes


MLP_UP = Shape("mlp_up.fwd", 8192, 5120, 1280)  # GPT-2 Large: 8192 tokens, d 1280 -> 4d 5120


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def bias_gelu_bench(ext: dict[str, Gemm], budget_s: float, seed: int = 1000, shape: Shape = MLP_UP,
                    device: str = "cuda") -> list[dict[str, object]]:
    """GELU_tanh(x W + b) at GPT-2 Large's MLP up-projection, forward: wgmma_persistent_bias_gelu (bias + GELU
    in the GEMM epilogue) against cuBLAS followed by a separate bias-GELU, three ways: eager add + gelu,
    cuBLAS with the bias in its epilogue (addmm) + gelu, cuBLAS + the project's fused Triton bias-GELU; and
    cuBLASLt with bias + GELU in its own epilogue (torch._addmm_activation) for reference. Each is checked
    against an fp64 reference (threshold TOLERANCE) before it is timed."""
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(seed)
    A = torch.randn(shape.M, shape.K, device=device, generator=g).to(torch.bfloat16)
    B = torch.randn(shape.K, shape.N, device=device, generator=g).to(torch.bfloat16)
    bias = torch.randn(shape.N, device=device, generator=g).to(torch.bfloat16)
    ref = gelu_tanh(A.double() @ B.double() + bias.double())
    C = torch.empty(shape.M, shape.N, device=device, dtype=torch.bfloat16)

    def ours() -> torch.Tensor:
        ext["wgmma_persistent_bias_gelu"](A, B, bias, C)
        return C

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "cublas + add + gelu (eager)": lambda: F.gelu(A @ B + bias, approximate="tanh"),
        "cublas addmm (bias) + gelu": lambda: F.gelu(torch.addmm(bias, A, B), approximate="tanh"),
    }
    try:
        from fused_kernels.triton.bias_gelu import bias_gelu as triton_bias_gelu

        variants["cublas + triton bias_gelu"] = lambda: triton_bias_gelu(A @ B, bias)
    except Exception as err:  # noqa: BLE001  (no Triton on this machine: leave the variant out)
        print(f"triton bias_gelu unavailable: {err}", flush=True)
    separate = list(variants)
    variants["cublasLt fused (_addmm_activation)"] = lambda: torch._addmm_activation(bias, A, B, use_gelu=True)
    if "wgmma_persistent_bias_gelu" in ext:
        variants["wgmma_persistent_bias_gelu"] = ours
    rows: list[dict[str, object]] = []
    for name, fn in variants.items():
        row: dict[str, object] = {"variant": name, "M": shape.M, "N": shape.N, "K": shape.K}
        rows.append(row)
        try:
            C.fill_(float("nan"))
            err = relative_error(fn(), ref)
            row["rel_err"] = f"{err:.2e}"
            if not err <= TOLERANCE:
                row["status"] = "FAIL"
                continue
            ms = timed_call_ms(fn, budget_s)
            row.update(status="PASS", time_ms=round(ms, 4), gflops=round(shape.flops / ms / 1e6, 1))
        except Exception as err:  # noqa: BLE001  (a launch error, or Triton failing to compile: record, go on)
            row["status"] = f"SKIP ({(str(err).splitlines() or [type(err).__name__])[0][:100]})"
        print(row, flush=True)
    return add_speedups(rows, separate)


def add_speedups(rows: list[dict[str, object]], separate: list[str], key: str = "time_ms") -> list[dict[str, object]]:
    """speedup_vs_best_separate = fastest timed `separate` variant / the row's time, on every timed row (only
    PASS rows are timed, so a FAIL never gets one)."""
    best_sep = min((r[key] for r in rows if r["variant"] in separate and key in r), default=None)
    for r in rows:
        if best_sep and key in r:
            r["speedup_vs_best_separate"] = round(best_sep / r[key], 3)
    return rows


def gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    """d/dx gelu_tanh: the formula the dgelu epilogue evaluates (in fp32 there, with tanh.approx)."""
    k = math.sqrt(2 / math.pi)
    t = torch.tanh(k * (x + 0.044715 * x**3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)


def over_tolerance(errors: dict[str, float], tolerance: float = TOLERANCE) -> list[str]:
    """The outputs whose relative error is above tolerance (NaN is)."""
    return [k for k, e in errors.items() if not e <= tolerance]


MLP_PART = {"fwd": ("h", "pre"), "bwd": ("dpre", "db")}  # each part's outputs, checked before the part is timed


def mlp_up_fwd_bwd_bench(ext: dict[str, Gemm], budget_s: float, seed: int = 1001, tokens: int = MLP_UP.M,
                         d: int = MLP_UP.K, device: str = "cuda") -> list[dict[str, object]]:
    """GPT-2 Large's MLP up-projection in training, forward + backward, at tokens x d -> 4d. Forward:
    pre = x Wt + b, h = GELU_tanh(pre) (pre kept for the backward); backward of GELU and b from dh = dy W_down (the
    down-projection's dgrad; W_down as nn.Linear stores it, [d, 4d] = [K, N]): dpre = dh * GELU'(pre),
    db = sum_rows dpre. Separate (eager training): addmm + gelu; matmul + aten.gelu_backward + a column sum (fp32 or
    bf16). Fused: wgmma_persistent_bias_gelu_aux (h and pre from one epilogue), wgmma_persistent_dgelu (dpre and db
    from the dgrad's epilogue; db zeroed inside the timed call). Every output is checked against fp64 (threshold
    TOLERANCE; the backward's reference is evaluated at the variant's own bf16 pre) before a part is timed; a FAIL
    row gets no time and no speedup. Inputs are scaled so pre ~ N(0, 2): GELU' is not just a 0/1 step."""
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(seed)
    n = 4 * d
    x = torch.randn(tokens, d, device=device, generator=g).to(torch.bfloat16)
    Wt = (torch.randn(d, n, device=device, generator=g) / math.sqrt(d)).to(torch.bfloat16)  # W_up^T: [K, N]
    b = torch.randn(n, device=device, generator=g).to(torch.bfloat16)
    dy = torch.randn(tokens, d, device=device, generator=g).to(torch.bfloat16)
    W_down = (torch.randn(d, n, device=device, generator=g) / math.sqrt(d)).to(torch.bfloat16)
    pre_ref = x.double() @ Wt.double() + b.double()
    h_ref = gelu_tanh(pre_ref)
    dh_ref = dy.double() @ W_down.double()

    def sep_fwd() -> dict[str, torch.Tensor]:
        pre = torch.addmm(b, x, Wt)
        return {"h": F.gelu(pre, approximate="tanh"), "pre": pre}

    def sep_bwd(pre: torch.Tensor, fp32_sum: bool) -> dict[str, torch.Tensor]:
        dpre = torch.ops.aten.gelu_backward(dy @ W_down, pre, approximate="tanh")
        return {"dpre": dpre, "db": dpre.float().sum(0) if fp32_sum else dpre.sum(0)}

    h, pre, dpre = (torch.empty(tokens, n, device=device, dtype=torch.bfloat16) for _ in range(3))
    db = torch.empty(n, device=device, dtype=torch.float32)

    def fused_fwd() -> dict[str, torch.Tensor]:
        ext["wgmma_persistent_bias_gelu_aux"](x, Wt, b, h, pre)
        return {"h": h, "pre": pre}

    def fused_bwd(aux: torch.Tensor) -> dict[str, torch.Tensor]:
        db.zero_()  # the epilogue accumulates into it
        ext["wgmma_persistent_dgelu"](dy, W_down, aux, dpre, db)
        return {"dpre": dpre, "db": db}

    # variant -> (forward, backward given the forward's outputs)
    variants: dict[str, tuple[Callable[[], dict[str, torch.Tensor]], Callable[..., dict[str, torch.Tensor]]]] = {
        "separate: addmm + gelu; matmul + gelu_backward + fp32 sum": (sep_fwd, lambda o: sep_bwd(o["pre"], True)),
        "separate: addmm + gelu; matmul + gelu_backward + bf16 sum": (sep_fwd, lambda o: sep_bwd(o["pre"], False)),
    }
    separate = list(variants)
    if "wgmma_persistent_bias_gelu_aux" in ext and "wgmma_persistent_dgelu" in ext:
        variants["fused: wgmma_persistent_bias_gelu_aux; wgmma_persistent_dgelu"] = (fused_fwd,
                                                                                    lambda o: fused_bwd(o["pre"]))
    flops = 2 * 2 * tokens * n * d  # the two GEMMs
    rows: list[dict[str, object]] = []
    for name, (fwd, bwd) in variants.items():
        row: dict[str, object] = {"variant": name, "tokens": tokens, "d": d, "d_ff": n}
        rows.append(row)
        try:
            for buf in (h, pre, dpre, db):
                buf.fill_(float("nan"))  # an output the kernel leaves unwritten fails
            out = fwd()
            bwd_out = bwd(out)
            dpre_ref = dh_ref * gelu_tanh_grad(out["pre"].double())  # at the bf16 pre this backward consumed
            refs = {"h": h_ref, "pre": pre_ref, "dpre": dpre_ref, "db": dpre_ref.sum(0)}
            errs = {k: relative_error(v, refs[k]) for k, v in {**out, **bwd_out}.items()}
            row.update({f"rel_err_{k}": f"{e:.2e}" for k, e in errs.items()})
            if failed := over_tolerance(errs):
                row["status"] = f"FAIL ({', '.join(failed)})"
                continue
            saved = {k: v.clone() for k, v in out.items()}  # the backward's input stays fixed while fwd is timed
            row["fwd_ms"] = round(timed_call_ms(fwd, budget_s), 4)
            row["bwd_ms"] = round(timed_call_ms(lambda bwd=bwd, saved=saved: bwd(saved), budget_s), 4)
            total = row["fwd_ms"] + row["bwd_ms"]
            row.update(status="PASS", total_ms=round(total, 4), gflops=round(flops / total / 1e6, 1))
        except Exception as err:  # noqa: BLE001  (a launch error: record, go on)
            row["status"] = f"SKIP ({(str(err).splitlines() or [type(err).__name__])[0][:100]})"
        print(row, flush=True)
    return add_speedups(rows, separate, key="total_ms")


def plot_roofline(rows: list[dict[str, object]], bw: float, peak_gflops: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [1, 10_000]
    ridge = peak_gflops * 1e9 / bw
    ax.plot([xs[0], ridge, xs[1]], [bw * xs[0] / 1e9, peak_gflops, peak_gflops], "k-", lw=1.5,
            label=f"roofline: {bw / 1e12:.2f} TB/s copy, {peak_gflops / 1e3:.0f} TFLOP/s best cuBLAS")
    markers = "osD^v<>p*"
    for j, name in enumerate(dict.fromkeys(r["kernel"] for r in rows)):
        pts = [(r["intensity"], r["gflops"]) for r in rows if r["kernel"] == name and r.get("status") == "PASS"]
        if pts:
            ax.scatter(*zip(*pts), s=18, marker=markers[j % len(markers)], label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte, bf16 A+B+C once)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def shapes_table(rows: list[dict[str, object]]) -> str:
    """Every shape but 4096^3: cuBLAS TFLOP/s and each hand-written kernel's % of cuBLAS (or its status)."""
    shapes = list(dict.fromkeys((r["shape"], r["M"], r["N"], r["K"]) for r in rows))
    shapes = [s for s in shapes if s != ("square", 4096, 4096, 4096)]
    names = [k for k in dict.fromkeys(r["kernel"] for r in rows) if k != "cublas"]
    by = {(r["kernel"], r["shape"], r["M"], r["N"], r["K"]): r for r in rows}
    table = []
    for s in shapes:
        cub = by.get(("cublas", *s), {})
        line: dict[str, object] = {"shape": s[0], "M x N x K": f"{s[1]} x {s[2]} x {s[3]}",
                                   "cuBLAS TFLOP/s": round(cub["gflops"] / 1e3, 1) if "gflops" in cub else ""}
        for k in names:
            r = by.get((k, *s), {})
            line[f"{k} %"] = r.get("pct_cublas", str(r.get("status", ""))[:12])
        table.append(line)
    return markdown_table(table, list(table[0])) if table else "not measured"


def bias_gelu_section(rows: list[dict[str, object]]) -> str:
    if not rows:
        return ""
    table = [{"variant": r["variant"], "status": r.get("status"), "rel err": r.get("rel_err", ""),
              "ms": r.get("time_ms", ""), "TFLOP/s": round(r["gflops"] / 1e3, 1) if "gflops" in r else "",
              "speedup vs best separate": r.get("speedup_vs_best_separate", "")} for r in rows]
    return f"""
## MLP up-projection with bias + GELU(tanh), forward ({MLP_UP.M} x {MLP_UP.N} x {MLP_UP.K})

{markdown_table(table, list(table[0]))}

Target: the fused epilogue >= 1.15x the best "cuBLAS + separate bias-GELU" variant.
The backward's fusion (pre-activation written by the forward epilogue, dpre and db in the dgrad's epilogue) is
timed in the forward + backward section; the up-projection's dX = dpre W and dW = dpre^T x stay plain GEMMs.
"""


def mlp_fwd_bwd_section(rows: list[dict[str, object]]) -> str:
    if not rows:
        return ""
    table = [{"variant": r["variant"], "status": r.get("status"),
              "rel err h / pre / dpre / db": " / ".join(str(r.get(f"rel_err_{k}", "-")) for k in ("h", "pre", "dpre",
                                                                                                   "db")),
              "fwd ms": r.get("fwd_ms", ""), "bwd ms": r.get("bwd_ms", ""), "total ms": r.get("total_ms", ""),
              "speedup vs best separate": r.get("speedup_vs_best_separate", "")} for r in rows]
    r0 = rows[0]
    return f"""
## MLP up-projection with bias + GELU(tanh), forward + backward ({r0["tokens"]} tokens, {r0["d"]} -> {r0["d_ff"]})

{markdown_table(table, list(table[0]))}

Forward: h = GELU(x W_up^T + b) and the pre-activation pre; backward from the down-projection's dgrad dh = dy W_down:
dpre = dh * GELU'(pre), db = column sums of dpre. Fused: the forward epilogue writes h and pre (bias_gelu_aux), the
dgrad's epilogue computes dpre and accumulates db (dgelu). Target: fused total >= 1.15x the best separate.
"""


def summary(rows: list[dict[str, object]], bw: float, peak_gflops: float, title: str,
            bias_rows: list[dict[str, object]] | None = None, mlp_rows: list[dict[str, object]] | None = None) -> str:
    head = [r for r in rows if r["shape"] == "square" and r["M"] == 4096]
    table = [{"kernel": r["kernel"], "status": r.get("status"), "rel err": r.get("rel_err", ""),
              "TFLOP/s": round(r["gflops"] / 1e3, 1) if "gflops" in r else "",
              "% of cuBLAS": r.get("pct_cublas", "")} for r in head]
    hand_written = CUDA_KERNELS + HOPPER_KERNELS
    cuda = [r for r in head if r["kernel"] in hand_written and r.get("status") == "PASS" and "pct_cublas" in r]
    best = max(cuda, key=lambda r: r["pct_cublas"], default=None)
    if best is None:
        verdict = "No hand-written CUDA kernel passed at 4096^3."
    else:
        met = "met" if best["pct_cublas"] >= 100 * TARGET else "NOT met"
        verdict = (f"Best hand-written CUDA kernel at 4096^3: `{best['kernel']}`, {best['pct_cublas']}% of cuBLAS: "
                   f"target >= {100 * TARGET:.0f}% {met}.")
    return f"""# GEMM ladder, bf16 in, fp32 accumulate, bf16 out

{title}

Ceilings measured here: copy bandwidth {bw / 1e12:.2f} TB/s (device-to-device copy), best cuBLAS
{peak_gflops / 1e3:.0f} TFLOP/s. Correctness: relative Frobenius error against an fp64 product of the same
bf16 inputs, threshold {TOLERANCE}; output poisoned with NaN before each check.

## 4096 x 4096 x 4096

{markdown_table(table, list(table[0])) if table else "not measured"}

{verdict}

## Other shapes (GPT-2 Large training GEMMs: 8192 tokens, d 1280; % of cuBLAS)

{shapes_table(rows)}
{bias_gelu_section(bias_rows or [])}{mlp_fwd_bwd_section(mlp_rows or [])}
What limits the `mma_*` kernels: they use the Ampere-style `mma.sync` path (HMMA in SASS):
each warp feeds the tensor cores from registers that `ldmatrix` filled, so shared-memory reads,
register pressure (~225 registers per thread for a 64x64 warp tile, one 8-warp block per SM) and
issue slots sit between memory and math. On Hopper, cuBLAS uses `wgmma` (HGMMA: a warpgroup
multiplies straight out of shared memory, asynchronously) fed by TMA bulk copies with warp
specialisation (producer warps load, consumer warpgroups compute), and only that path reaches the
chip's tensor-core peak; on A100 the same mma.sync kernel is the right design. `wgmma` (Hopper
only, gemm_wgmma.cu) is that design: a TMA producer warpgroup, two consumer warpgroups issuing
wgmma m64n256k16, a 4-stage mbarrier ring, 128x256 tile. `wgmma_persistent`
(gemm_wgmma_persistent.cu) adds persistent CTAs (one per SM, grouped static tile order), a stage ring
that runs across tiles (the next tile's loads overlap the epilogue) and an epilogue through swizzled shared
memory written out by TMA stores.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="fewer squares; GPT-2 Large forward shapes only")
    p.add_argument("--time-budget-s", type=float, default=300, help="no new shape starts after this")
    p.add_argument("--point-budget-s", type=float, default=0.3, help="timing budget per (kernel, shape)")
    p.add_argument("--kernels", help="comma list of kernels to run (default all): cublas, "
                   + ", ".join(CUDA_KERNELS + HOPPER_KERNELS) + ", triton; include cublas for the %% column")
    p.add_argument("--shapes", default="4096,squares,gpt2",
                   help=f"comma list of shape groups among {', '.join(SHAPE_GROUPS)} (default: all but tail)")
    p.add_argument("--bias-gelu", action="store_true",
                   help="also time the MLP up-projection with bias + GELU fused (wgmma_persistent_bias_gelu), "
                   "forward alone and forward + backward (bias_gelu_aux, dgelu)")
    p.add_argument("--probe-timeout-s", type=float, default=300, help="per kernel probe subprocess")
    p.add_argument("--probe", choices=CUDA_KERNELS + HOPPER_KERNELS, help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.probe:
        sys.exit(probe(args.probe))
    if not torch.cuda.is_available():
        sys.exit("the GEMM benchmark needs a CUDA GPU")
    bad = set(args.shapes.split(",")) - set(SHAPE_GROUPS)
    if bad:
        sys.exit(f"unknown shape groups {sorted(bad)}; choose among {SHAPE_GROUPS}")
    t_start = time.time()
    names = [k for k in selected(args) if k not in ("cublas", "triton")]
    if args.bias_gelu and "wgmma_persistent" in cuda_kernels():
        names = list(dict.fromkeys([*names, "wgmma_persistent"]))
    ext = build_extension(verbose=args.verbose, kernels=names)
    rows, probes = run(args, ext, t_start)
    tag = device_tag("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("wrote", write_csv(out / "gemm.csv", rows, tag))  # rewritten below with the copy bandwidth
    bias_rows, mlp_rows = [], []
    if args.bias_gelu:  # the fused variants only if their mainloop (wgmma_persistent) passed the probe
        usable = {k: v for k, v in ext.items() if k not in FUSED_EPILOGUES or probes.get("wgmma_persistent") == "ok"}
        bias_rows = bias_gelu_bench(usable, args.point_budget_s)
        print("wrote", write_csv(out / "gemm_bias_gelu.csv", bias_rows, tag))
        mlp_rows = mlp_up_fwd_bwd_bench(usable, args.point_budget_s)
        print("wrote", write_csv(out / "gemm_mlp_fwd_bwd.csv", mlp_rows, tag))
    bw = copy_bandwidth()
    peak = max((r["gflops"] for r in rows if r["kernel"] == "cublas" and "gflops" in r), default=1.0)
    title = tag_line(tag)
    print("wrote", write_csv(out / "gemm.csv", rows, {**tag, "copy_bw_GBps": f"{bw / 1e9:.0f}"}))
    plot_roofline(rows, bw, peak, out / "gemm_roofline.png", f"GEMM ladder (bf16): {title}")
    text = summary(rows, bw, peak, title, bias_rows, mlp_rows)
    (out / "gemm_summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
