"""Tensor-parallel GPT-2 step time with and without comm/compute overlap and sequence parallelism.

    torchrun --nproc_per_node=4 -m benchmarks.tp_overlap --tp 4 --out benchmarks/results/tp [--model gpt2-large]

One forward + backward (no optimizer) of the TP model under bf16 autocast, for every (sequence parallel,
overlap) combination, on one TP group of `--tp` ranks (extra ranks form data-parallel replicas that run
the same thing). Reports the median step time of the slowest rank, tokens/s per TP group, and the TP
communication payload of one step as counted by `parallel.comm.CommStats`. Rank 0 writes
tp_overlap_tp{tp}.csv. Runs on CPU with gloo too (tiny model, for smoke tests).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.measure import time_ms
from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.model.gpt import GPT
from parallel.comm import CommStats
from parallel.dims import ParallelDims
from parallel.grads import allreduce_sequence_parallel_grads
from parallel.tp_plan import apply_tensor_parallel
from tools.common import device_tag, write_csv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-large", choices=sorted(MODEL_PRESETS))
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/tp")
    return p.parse_args(argv)


def run_config(args: argparse.Namespace, dims: ParallelDims, device: torch.device, sp: bool,
               overlap: bool) -> dict[str, object]:
    cfg = ModelConfig(**{**MODEL_PRESETS[args.model], "n_positions": max(1024, args.seq_len)})
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    stats = CommStats()
    apply_tensor_parallel(model, dims, sequence_parallel=sp, overlap=overlap, stats=stats)
    gen = torch.Generator().manual_seed(dims.dp_rank)
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen).to(device)
    targets = torch.roll(idx, -1, dims=1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            loss, _ = model(idx, targets)
        loss.backward()
        allreduce_sequence_parallel_grads(model, dims, stats)
        model.zero_grad(set_to_none=True)

    step()
    bytes_per_step = dict(stats.bytes)
    times = time_ms(step, args.iters, args.warmup, device)
    slowest = torch.tensor(statistics.median(times), device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ms = slowest.item()
    return {
        "model": args.model, "tp": dims.tp_size, "dp": dims.dp_size, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "sequence_parallel": sp, "overlap": overlap, "step_ms": round(ms, 3),
        "tokens_per_s_per_tp_group": round(args.batch_size * args.seq_len / ms * 1e3),
        **{f"bytes_{op}_{phase}": bytes_per_step.get((op, phase), 0)
           for op in ("all_reduce", "all_gather", "reduce_scatter") for phase in ("fwd", "bwd", "grad")},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        dims = ParallelDims(world_size=dist.get_world_size(), rank=dist.get_rank(), tp_size=args.tp)
        dims.build_groups()
        rows = []
        for sp in (False, True):
            for overlap in (False, True):
                rows.append(run_config(args, dims, device, sp, overlap))
                if dims.rank == 0:
                    print(rows[-1], flush=True)
        if dims.rank == 0:
            path = write_csv(Path(args.out) / f"tp_overlap_tp{args.tp}.csv", rows, device_tag(device))
            print(f"wrote {path}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
