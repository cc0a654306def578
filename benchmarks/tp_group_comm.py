"""All-reduce time on the training grid's own groups: TP groups, DP groups and the whole world.

    torchrun --nproc_per_node=4 -m benchmarks.tp_group_comm --tp-size 2 [--mib 20] [--dtype bf16]

Builds the groups exactly as training does (`parallel.dims.ParallelDims.build_groups`), then times an
all-reduce of one TP activation (default 8 x 1024 x 1280 bf16 = 20 MiB, GPT-2 Large at batch 8) on each:
alone, and while the same rank runs bf16 GEMMs on another stream (as in training, where the collective
shares the GPU with compute). Time per call = mean of `iters` back-to-back calls between CUDA events, the
slowest rank's; bus bandwidth with nccl-tests' all-reduce factor 2(n-1)/n. Rank 0 prints a Markdown table.
Run with NCCL_DEBUG=INFO to see which transport and protocol NCCL picked for each group.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from gpt2.planning.perf_model import bus_factor
from parallel.dims import ParallelDims
from tools.common import markdown_table

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--mib", type=float, default=20.0, help="message size in MiB")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=50)
    return p.parse_args(argv)


def time_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, iters: int, busy: bool) -> float:
    """Seconds per all-reduce (slowest rank), optionally with a GEMM loop running on a side stream."""
    gemm_stream = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=x.device, dtype=torch.bfloat16)
    for _ in range(5):
        dist.all_reduce(x, group=group)
    dist.barrier()
    torch.cuda.synchronize()
    if busy:
        with torch.cuda.stream(gemm_stream):
            for _ in range(iters * 4):
                a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dist.all_reduce(x, group=group)
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end) / 1e3 / iters], device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    dims = ParallelDims(world_size=dist.get_world_size(), rank=dist.get_rank(), tp_size=args.tp_size)
    dims.build_groups()
    dtype = DTYPES[args.dtype]
    numel = int(args.mib * 2**20) // torch.tensor([], dtype=dtype).element_size()
    x = torch.ones(numel, device=device, dtype=dtype)
    rows = []
    for name, group, size in (("tp", dims.tp_group, dims.tp_size), ("dp", dims.dp_group, dims.dp_size),
                              ("world", None, dims.world_size)):
        if size == 1:
            continue
        for busy in (False, True):
            t = time_all_reduce(x, group, args.iters, busy)
            busbw = x.numel() * x.element_size() / t * bus_factor("all_reduce", size) / 1e9
            rows.append({"group": name, "ranks": size, "while": "GEMMs on a side stream" if busy else "idle",
                         "time (us)": f"{t * 1e6:.1f}", "busbw (GB/s)": f"{busbw:.1f}"})
    if dist.get_rank() == 0:
        print(f"all-reduce of {args.mib:g} MiB {args.dtype}, world {dims.world_size}, tp {dims.tp_size}, "
              f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
        print(markdown_table(rows, ["group", "ranks", "while", "time (us)", "busbw (GB/s)"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
