"""The optimizer step over GPT-2's parameters against its memory bound: the engine's step as train.py calls it,
beside torch's AdamW variants and flat-buffer ones, each timed alone on the device.

    python -m benchmarks.optimizer_step --out benchmarks/results/optimizer_step                 # GPT-2 Large, CUDA
    python -m benchmarks.optimizer_step --out /tmp/opt --profile                                # + one step's kernels
    python -m benchmarks.optimizer_step --model gpt2-tiny --device cpu --iters 3 --no-compile --out /tmp/opt

The parameters are the model's own (`gpt2.engines.build.build_engine` for `--mode single --model M`: fp32 weights on
the device, AdamW's two groups of `gpt2.runtime.parallelize.param_groups`); the gradients are fp32 tensors with a
global norm of half the clip, so clipping never changes a value and every call does the same work. Before each call
the gradients are attached again (host only, outside the timing), since the step ends with zero_grad.

Rows (N parameters, 4 bytes each; `min_GB` is what a row must move at least, each tensor read or written once):
- engine: `TorchEngine.optimizer_step` + `guard.record`, what train.py runs a step: the global norm (reads the
  gradients), the fused AdamW with the clip divisor and the non-finite flag (reads weights, gradients, two moments;
  writes weights, moments and, because it divides them, the gradients), the schedule, zero_grad. 36N bytes.
- clip-first: the step before the clip went into the fused AdamW: `torch.nn.utils.clip_grad_norm_` (norm, then a
  multiply that reads and writes every gradient), then the guarded fused AdamW without a divisor. 40N.
- fused, foreach: `torch.optim.AdamW(fused=True)` / `(foreach=True)` alone over the same groups: no norm, no
  clip, no guard. 28N (the AdamW bound; foreach runs several passes, so it moves more than it is credited with).
- fused-flat, fused-flat+clip: the same fused AdamW over one flat fp32 buffer per group (weights, gradients and
  moments: two tensors where the model has hundreds); +clip is the engine's recipe on them (norm, divisor, flag).
  28N / 36N. Only the optimizer is timed: in training, flat gradients would cost the backward an accumulation
  into the buffer (autograd adds into an existing .grad instead of taking the new tensor), except under DDP,
  whose buckets already hold the gradients (`gradient_as_bucket_view=True`).
- compiled-flat+clip: the norm, then one torch.compile'd elementwise function per group over the flat buffers
  (clip, AdamW, the non-finite skip as a select): what a single-pass kernel reaches; 32N, the bound of a clipped
  step (the clip needs every gradient before any update, so the norm's read cannot be folded in).
- triton+clip: the norm, then `fused_kernels.triton.adamw.adamw_step` over the model's own tensors: one Triton launch
  per group through tables of the tensors' addresses, the divisor applied as each gradient is read and the gradient
  not written back (the engine's recipe at 32N, the clipped-step bound, without flat buffers). Needs a GPU, or
  TRITON_INTERPRET=1 on the CPU.
- compiled-lists+clip (only when --variants names it; its compile takes minutes): the same compiled update over
  the model's own tensors, no flat buffers (Inductor: a kernel per tensor); 32N. What a compiled optimizer in
  the engines would reach without changing the parameters' layout.
- engine-triton: the engine's step as train.py runs it with --optimizer triton (`RunLayout.triton_adamw`, an
  engine of its own): the norm by `fused_kernels.triton.adamw.grad_norm` (the update's tables), then the Triton
  update; the guard, schedule and zero_grad as in engine. 32N, the clipped-step bound. Needs a GPU, or
  TRITON_INTERPRET=1 on the CPU.
- grad-norm, clip-mul: the two parts of clip-first before its AdamW (4N, 8N); triton-norm: engine-triton's norm (4N).
- copy: `dst.copy_(src)` of a large fp32 buffer (read + write): the bandwidth the bounds divide by.

Timing (CUDA): each call after `torch.cuda._sleep` holds the stream, so the host queues the whole step before the
device starts it: `ms` is the device's time from the step's first kernel to its last (CUDA events), the median of
--iters calls after --warmup; `wall_ms` waits for the device before and after each call (perf_counter): it adds
the host's launch time where the host is slower than the device. In training the host queues the step while the
device still runs the backward, so `ms` is what the step costs a step. On CPU both are perf_counter.
`x_adamw_bound` = ms / (28N bytes / copy bandwidth): the figure the optimizer target is stated in.
Results: optimizer_step.csv and optimizer_step.md in --out (tagged with device, torch version, date and commit);
--profile adds optimizer_step_profile.md: each variant's kernels in one step (name, launches, device time).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import torch

from benchmarks.launched_step import launch
from benchmarks.measure import cuda_event_ms
from gpt2.engines.build import build_engine
from gpt2.engines.guard import clip_divisor, step_if_finite
from gpt2.observe.profiling import is_kernel
from gpt2.runtime.distributed import shutdown_distributed
from gpt2.runtime.parallelize import param_groups
from tools.common import device_tag, markdown_table, tag_line, write_csv

ADAMW_BYTES = 28  # per fp32 parameter: weight, gradient, two moments read (16); weight, two moments written (12)
COPY_BYTES = 2**30  # the copy-bandwidth buffer (1 GiB read, 1 GiB written)
SLEEP_CYCLES = 50_000_000  # device cycles the stream waits while the host queues a step (tens of ms)
COLUMNS = ["variant", "tensors", "ms", "wall_ms", "min_GB", "GB/s", "pct_of_copy_bw", "x_adamw_bound", "error"]
VARIANTS = ("engine", "clip-first", "fused", "foreach", "fused-flat", "fused-flat+clip", "compiled-flat+clip",
            "triton+clip", "engine-triton", "grad-norm", "triton-norm", "clip-mul", "copy")
TRITON = ("triton+clip", "engine-triton", "triton-norm")  # Triton kernels: seconds a call in the CPU interpreter
COMPILED = ("compiled-flat+clip", "compiled-lists+clip")
OPT_IN = ("compiled-lists+clip",)  # only when --variants names it: Inductor compiles a graph of every tensor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.optimizer_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for optimizer_step.csv/.md (and the profile)")
    p.add_argument("--model", default="gpt2-large", help="GPT-2 preset whose parameters are stepped")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per variant (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (optimizer state, compilation)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from {','.join(VARIANTS + OPT_IN)} (default: all but {','.join(OPT_IN)})")
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled variants (Inductor's compile)")
    p.add_argument("--profile", action="store_true", help="also write one step's kernel table per variant")
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS + OPT_IN)
    if unknown:
        p.error(f"unknown --variants {sorted(unknown)}; choose from {', '.join(VARIANTS + OPT_IN)}")
    return args


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed(step: Callable[[], object], before: Callable[[], None], device: torch.device, iters: int,
          warmup: int) -> tuple[float, float]:
    """(median device ms, median wall ms) of `step`, `before` run untimed ahead of each call."""
    on_gpu = device.type == "cuda"
    for _ in range(warmup):
        before()
        step()
    device_ms, wall_ms = [], []
    for _ in range(iters):
        before()
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)  # the host queues the whole step meanwhile
            device_ms.append(cuda_event_ms(step))
            before()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if on_gpu:
            torch.cuda.synchronize()
        wall_ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(device_ms or wall_ms), statistics.median(wall_ms)


def copy_bandwidth(device: torch.device, iters: int) -> tuple[float, float, float]:
    """(GB/s, ms, GB moved) of a large device-to-device copy, read + write counted."""
    n = COPY_BYTES // 4 if device.type == "cuda" else 2**24
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    ms, _ = timed(lambda: dst.copy_(src), lambda: None, device, iters, warmup=2)
    return 2 * 4 * n / ms / 1e6, ms, 2 * 4 * n / 1e9


def flat_groups(groups: list[dict], grads: dict[int, torch.Tensor]) -> tuple[list[dict], list[torch.Tensor]]:
    """AdamW groups of one flat fp32 weight per group (a copy), and each one's flat gradient."""
    flat, flat_grads = [], []
    for group in groups:
        weight = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in group["params"]]))
        flat.append({**group, "params": [weight]})
        flat_grads.append(torch.cat([grads[id(p)].reshape(-1) for p in group["params"]]))
    return flat, flat_grads


def adamw_update(ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor],
                 step: torch.Tensor, divisor: torch.Tensor, skip: torch.Tensor, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float) -> None:
    """torch's AdamW (decoupled decay, bias-corrected; one step count for the group) in place, each gradient divided
    by `divisor`, nothing changed where `skip`: compiled, one elementwise kernel per tensor reads p, g, m, v and
    writes p, m, v (the gradient is not written back)."""
    step_new = step + 1
    bc1, bc2 = 1 - beta1**step_new, 1 - beta2**step_new
    for p, g, m, v in zip(ps, gs, ms, vs):
        g = g / divisor
        m_new = beta1 * m + (1 - beta1) * g
        v_new = beta2 * v + (1 - beta2) * g * g
        p_new = p * (1 - lr * weight_decay) - (lr / bc1) * m_new / (v_new.sqrt() / bc2.sqrt() + eps)
        p.copy_(torch.where(skip, p, p_new))
        m.copy_(torch.where(skip, m, m_new))
        v.copy_(torch.where(skip, v, v_new))
    step.copy_(torch.where(skip, step, step_new))


@dataclass
class Setup:
    """The engine's parameters with fixed gradients (global norm: half the clip, so clipping changes nothing and
    every call does the same work), shared by the variants."""

    engine: Any
    clip: float
    params: list[torch.nn.Parameter] = field(init=False)
    grads: dict[int, torch.Tensor] = field(init=False)
    steps: Iterator[int] = field(init=False)

    def __post_init__(self) -> None:
        self.params = [p for g in self.engine.optimizer.param_groups for p in g["params"]]
        device = self.params[0].device
        gen = torch.Generator(device=device).manual_seed(0)
        self.grads = {id(p): torch.randn(p.shape, device=device, generator=gen) for p in self.params}
        norm = torch.nn.utils.get_total_norm(list(self.grads.values()))
        for g in self.grads.values():
            g.mul_(0.5 * self.clip / norm)
        self.steps = count(1)

    @property
    def n(self) -> int:
        return sum(p.numel() for p in self.params)

    def attach(self) -> None:
        for p in self.params:
            p.grad = self.grads[id(p)]


@dataclass
class Variant:
    tensors: int  # tensors per list the optimizer's kernels see
    bytes_per_param: int  # what the step must move at least, per parameter
    step: Callable[[], object]
    before: Callable[[], None]  # untimed, ahead of each call


def compiled_variant(weights: list[list[torch.Tensor]], grads: list[list[torch.Tensor]], groups: list[dict],
                     t: Any, clip: float) -> Variant:
    """The norm, then `adamw_update` compiled once per group over its tensors (own moments, zeros at first)."""
    device = weights[0][0].device
    update = torch.compile(adamw_update, fullgraph=True, dynamic=False)
    states = [(ws, gs, [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws],
               torch.zeros((), device=device), group["weight_decay"]) for ws, gs, group in zip(weights, grads, groups)]
    every_grad = [g for gs in grads for g in gs]

    def compiled_step() -> None:
        total = torch.nn.utils.get_total_norm(every_grad)
        divisor, skip = clip_divisor(total, clip), ~torch.isfinite(total)
        for ps, gs, ms, vs, step, wd in states:
            update(ps, gs, ms, vs, step, divisor, skip, t.lr, t.beta1, t.beta2, 1e-8, wd)

    return Variant(len(every_grad), 32, compiled_step, lambda: None)


def make_variant(name: str, s: Setup) -> Variant:
    """One row's step over the setup's parameters (its own optimizer state or flat copies where it needs them)."""
    engine, opt, t, clip = s.engine, s.engine.optimizer, s.engine.cfg.train, s.clip
    device = s.params[0].device
    hyper = dict(lr=t.lr, betas=(t.beta1, t.beta2))
    loss = torch.ones((), device=device)
    if name in ("engine", "engine-triton"):  # engine-triton: s is an engine built with --optimizer triton (`setup_for`)
        assert engine.layout.triton_adamw is (name == "engine-triton")
        return Variant(len(s.params), 32 if engine.layout.triton_adamw else 36,
                       lambda: engine.guard.record(next(s.steps), loss, engine.optimizer_step()), s.attach)
    if name == "clip-first":
        def clip_first() -> None:
            engine.scaler.unscale_(opt)
            step_if_finite(opt, torch.nn.utils.clip_grad_norm_(s.params, clip))
            engine.scaler.update()
            opt.zero_grad(set_to_none=True)
            engine.scheduler.step()

        return Variant(len(s.params), 40, clip_first, s.attach)
    if name in ("fused", "foreach"):
        alone = torch.optim.AdamW(param_groups(engine.module, t.weight_decay), **hyper, **{name: True})
        return Variant(len(s.params), ADAMW_BYTES, alone.step, s.attach)
    if name == "grad-norm":
        return Variant(len(s.params), 4, lambda: torch.nn.utils.get_total_norm(list(s.grads.values())), s.attach)
    if name == "clip-mul":
        coef = torch.ones((), device=device)
        return Variant(len(s.params), 8, lambda: torch._foreach_mul_(list(s.grads.values()), coef), s.attach)
    if name == "triton-norm":
        from fused_kernels.triton.adamw import grad_norm

        return Variant(len(s.params), 4, lambda: grad_norm(opt), s.attach)
    if name == "triton+clip":
        from fused_kernels.triton.adamw import adamw_step

        own = torch.optim.AdamW(param_groups(engine.module, t.weight_decay), **hyper)  # its state; stepped by Triton

        def triton_step() -> None:
            total = torch.nn.utils.get_total_norm(list(s.grads.values()))
            adamw_step(own, clip_divisor(total, clip), (~torch.isfinite(total)).float())

        return Variant(len(s.params), 32, triton_step, s.attach)
    if name == "compiled-lists+clip":
        groups = opt.param_groups
        return compiled_variant([[p.detach() for p in g["params"]] for g in groups],
                                [[s.grads[id(p)] for p in g["params"]] for g in groups], groups, t, clip)
    groups, flat_grads = flat_groups(opt.param_groups, s.grads)
    weights = [g["params"][0] for g in groups]
    if name in ("fused-flat", "fused-flat+clip"):
        flat = torch.optim.AdamW(groups, **hyper, fused=True)

        def attach_flat() -> None:
            for w, g in zip(weights, flat_grads):
                w.grad = g

        def flat_clip() -> None:
            total = torch.nn.utils.get_total_norm(flat_grads)
            step_if_finite(flat, total, clip_divisor(total, clip))

        clipped = name.endswith("+clip")
        return Variant(len(weights), 36 if clipped else ADAMW_BYTES, flat_clip if clipped else flat.step, attach_flat)
    if name == "compiled-flat+clip":
        return compiled_variant([[w.detach()] for w in weights], [[g] for g in flat_grads], groups, t, clip)
    raise ValueError(f"unknown variant {name!r}")


def setup_for(name: str, setup: Setup, train_argv: list[str]) -> Setup:
    """The setup a variant steps: `setup`, or for engine-triton one of its own, over an engine built with
    --optimizer triton (its own copy of the model: the same weights and gradients, by the same seeds)."""
    if name != "engine-triton":
        return setup
    layout, ctx, _ = launch([*train_argv, "--optimizer", "triton"])
    return Setup(build_engine(layout, ctx), setup.clip)


def profile_table(name: str, step: Callable[[], object], before: Callable[[], None], device: torch.device) -> str:
    """Markdown: the kernels (CUDA) or operators (CPU) of one call of `step`: name, launches, time."""
    from torch.profiler import ProfilerActivity, profile

    before()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if is_kernel(e)]
    on_device = bool(kernels)
    rows: dict[str, list[float]] = {}
    for e in kernels if on_device else [e for e in events if e.cpu_parent is None]:
        us = e.self_device_time_total if on_device else e.cpu_time_total
        row = rows.setdefault(e.key, [0, 0.0])
        row[0] += 1
        row[1] += us
    table = [{"kernel" if on_device else "op": key[:110], "launches": c, "us": round(us, 1)}
             for key, (c, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])]
    total = sum(r["us"] for r in table)
    cols = ["kernel" if on_device else "op", "launches", "us"]
    return (f"## {name}\n\n{sum(r['launches'] for r in table)} {'kernels' if on_device else 'top-level ops'}, "
            f"{total / 1000:.3f} ms {'device' if on_device else 'CPU'} time\n\n{markdown_table(table, cols)}\n")


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    args = parse_args(argv)
    train_argv = ["--mode", "single", "--model", args.model]
    if args.device:
        train_argv += ["--device", args.device]
    layout, ctx, _ = launch(train_argv)
    engine = build_engine(layout, ctx)
    device = ctx.device
    clip = layout.cfg.train.grad_clip or 1.0
    variants = args.variants.split(",")
    bandwidth, copy_ms, copy_gb = copy_bandwidth(device, max(args.iters, 3))
    rows: list[dict[str, object]] = []
    profiles: list[str] = []
    setup = Setup(engine, clip)
    n = setup.n
    for name in variants:
        if name == "copy" or (name in COMPILED and args.no_compile):
            continue
        row: dict[str, object] = {"variant": name}
        try:
            variant = make_variant(name, setup_for(name, setup, train_argv))
            row.update(tensors=variant.tensors, bytes_per_param=variant.bytes_per_param)
            ms, wall = timed(variant.step, variant.before, device, args.iters, args.warmup)
            row.update(ms=round(ms, 3), wall_ms=round(wall, 3))
            if args.profile:
                profiles.append(profile_table(name, variant.step, variant.before, device))
        except Exception as err:  # one failing variant leaves the others' rows
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        rows.append(row)
        variant = None  # its optimizer state and flat copies go before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "copy" in variants:
        rows.append({"variant": "copy", "tensors": 1, "ms": round(copy_ms, 3), "min_GB": round(copy_gb, 3),
                     "GB/s": round(bandwidth, 1), "pct_of_copy_bw": 100.0})
    bound_ms = ADAMW_BYTES * n / bandwidth / 1e6
    for row in rows:
        row["params"] = n
        if row["variant"] == "copy":
            continue
        if "bytes_per_param" in row:
            row["min_GB"] = round(row["bytes_per_param"] * n / 1e9, 3)
        if row.get("ms"):
            row["GB/s"] = round(row["min_GB"] / row["ms"] * 1e3, 1)
            row["pct_of_copy_bw"] = round(100 * row["GB/s"] / bandwidth, 1)
            row["x_adamw_bound"] = round(row["ms"] / bound_ms, 2)
    tag = {**device_tag(device), "commit": commit(), "model": args.model}
    command = " ".join(["python -m benchmarks.optimizer_step", *(sys.argv[1:] if argv is None else argv)])
    header = (f"{tag_line(tag)}, commit {tag['commit']}: {args.model}, {n:,} fp32 parameters; copy bandwidth "
              f"{bandwidth:.0f} GB/s; AdamW bound ({ADAMW_BYTES} B/param, {ADAMW_BYTES * n / 1e9:.2f} GB) "
              f"{bound_ms:.3f} ms, clipped-step bound (32 B/param) {32 * n / bandwidth / 1e6:.3f} ms; "
              f"median of {args.iters} calls after {args.warmup}")
    report = (f"# The optimizer step against its memory bound\n\n{header}\n\n`{command}`\n\n"
              f"{markdown_table(rows, COLUMNS)}\n")
    print("\n" + report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer_step.md").write_text(report)
    write_csv(args.out / "optimizer_step.csv", rows, tag)
    if args.profile:
        (args.out / "optimizer_step_profile.md").write_text(
            f"# One optimizer step's kernels per variant\n\n{header}\n\n" + "\n".join(profiles))
    shutdown_distributed(all_ranks_finished=True)
    return rows


if __name__ == "__main__":
    main()
