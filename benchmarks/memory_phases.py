"""Where one training step's GPU memory goes, phase by phase, beside the planner's terms: what checks the planner's
memory model (gpt2.planning.planner) against a run whose `plan/peak_error` says it is off.

    torchrun --nproc_per_node=2 -m benchmarks.memory_phases --out /tmp/mem.txt -- --mode hybrid --zero-engine fsdp2 \
        --model gpt2-large --seq-len 1024 --batch-size 8 --precision bf16 --compile

The flags after `--` are train.py's (synthetic tokens are forced; --grad-accum 1: one forward and one backward make
the step). The engine and its calls are the ones train.py runs (`gpt2.engines.build.build_engine`,
`forward_backward`, `optimizer_step`). After --warmup steps, one step is measured on rank 0 (CUDA only; elsewhere the
report holds the plan alone): allocated between steps, after the forward (a forward hook on the engine's model, the
outermost module), the peak of the backward, allocated after it, the peak of the optimizer step; and the tensors
alive after the forward by where they were allocated (`torch.cuda.memory._record_memory_history`, started after the
warm-up: what was allocated before, the weights, optimizer states and persistent buffers, shows as one line).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.launched_step import launch, split_argv
from gpt2.engines.build import build_engine
from gpt2.planning.planner import predict_memory
from gpt2.runtime.distributed import run_as_process, shutdown_distributed
from gpt2.train.loop import train_step

GIB = 1024**3
BEFORE = "(allocated before the recording: weights, optimizer states, persistent buffers)"
# the frames that name an allocation's owner, innermost first; otherwise the innermost frame
OWNERS = ("/gpt2/", "/parallel/", "/fsdp/", "/deepspeed/", "/_inductor/", "/optim/", "/autograd/", "/amp/")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    own, train_argv = split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the report (text)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured one (compilation, allocator)")
    p.add_argument("--top", type=int, default=25, help="allocation sites listed")
    return p.parse_args(own), train_argv


def owner(frames: list[dict[str, Any]]) -> str:
    """`file:function` of the innermost frame in one of OWNERS (the innermost frame if none)."""
    for frame in frames:
        if any(key in frame["filename"] for key in OWNERS):
            break
    else:
        frame = frames[0]
    return f"{'/'.join(Path(frame['filename']).parts[-2:])}:{frame['name']}"


def live_by_owner(snapshot: dict[str, Any]) -> Counter:
    """Bytes of the live tensors of a `torch.cuda.memory._snapshot()` by allocation site."""
    sites: Counter = Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                frames = block.get("frames") or []
                sites[owner(frames) if frames else BEFORE] += block["size"]
    return sites


def measure_step(engine: Any, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                 ) -> tuple[dict[str, float], Counter]:
    """One step's phases (GiB) and the live tensors after its forward (bytes by site)."""
    cuda = torch.cuda
    phases: dict[str, float] = {}
    after_forward: dict[str, Any] = {}

    def forward_done(*_: Any) -> None:
        phases["after forward"] = cuda.memory_allocated(device) / GIB
        phases["forward peak"] = cuda.max_memory_allocated(device) / GIB
        after_forward["snapshot"] = cuda.memory._snapshot()
        cuda.reset_peak_memory_stats(device)

    cuda.synchronize(device)
    phases["between steps"] = cuda.memory_allocated(device) / GIB
    cuda.reset_peak_memory_stats(device)
    cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    hook = engine.model.register_forward_hook(forward_done)
    try:
        engine.forward_backward(*batch, last_micro_step=True)
    finally:
        hook.remove()
        cuda.memory._record_memory_history(enabled=None)
    cuda.synchronize(device)
    phases["backward peak"] = cuda.max_memory_allocated(device) / GIB
    phases["after backward"] = cuda.memory_allocated(device) / GIB
    cuda.reset_peak_memory_stats(device)
    engine.optimizer_step()
    cuda.synchronize(device)
    phases["optimizer-step peak"] = cuda.max_memory_allocated(device) / GIB
    return phases, live_by_owner(after_forward["snapshot"])


def main(argv: list[str] | None = None) -> int:
    args, train_argv = parse_args(argv)
    layout, ctx, data = launch(train_argv)
    if layout.grad_accum != 1:
        raise SystemExit("benchmarks.memory_phases measures one forward and one backward a step: use --grad-accum 1")
    engine = build_engine(layout, ctx)
    for _ in range(args.warmup):
        train_step(layout, ctx, engine, data)
    lines = [f"flags: {' '.join(train_argv)}", f"device: {ctx.device}, torch {torch.__version__}", "",
             "planner (GiB):", *(f"  {k:<28}{v:8.2f}" for k, v in predict_memory(layout).as_gib().items())]
    if ctx.device.type == "cuda":
        x, y = data.train.next_batch()
        batch = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        phases, sites = measure_step(engine, batch, ctx.device)
        lines += ["", f"measured on rank {ctx.rank} (GiB):", *(f"  {k:<28}{v:8.2f}" for k, v in phases.items()),
                  "", f"live after the forward, by allocation site (top {args.top}, GiB):",
                  *(f"  {n / GIB:8.3f}  {site}" for site, n in sites.most_common(args.top)),
                  f"  {sum(sites.values()) / GIB:8.3f}  total"]
    else:
        lines += ["", f"no measurement: {ctx.device} has no allocator statistics (CUDA only)"]
    if ctx.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    shutdown_distributed(all_ranks_finished=True)
    return 0


if __name__ == "__main__":
    run_as_process(main)
