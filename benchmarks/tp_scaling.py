"""Strong and weak scaling of our column- and row-parallel linear layers (forward + backward).

    torchrun --nproc_per_node=4 -m benchmarks.tp_scaling --out benchmarks/results/tp_scaling     # measures tp=4
    python -m benchmarks.tp_scaling --nprocs 1 2 4 --out benchmarks/results/tp_scaling          # 1, 2, 4 + merge
    python -m benchmarks.tp_scaling --merge --out benchmarks/results/tp_scaling                 # merge only

Under torchrun with N processes the whole world is one TP group of N ranks, and rank 0 writes
tp_scaling_tp{N}.csv. `--nprocs` launches that for each N in turn and then merges: tp_scaling.csv gains
speed-up and efficiency against the tp=1 row of the same (scaling, layer, overlap), plus plots.

Problem (default: the GPT-2 Large MLP, 8192 tokens x 1280 -> 5120 -> 1280, bf16 on GPU):
  - strong scaling: fixed global shapes, each rank holds 1/tp of the 5120 features;
    speed-up = t(1) / t(tp), efficiency = speed-up / tp.
  - weak scaling: the split features grow with tp (5120 x tp), so every rank's shard and GEMMs stay the
    size of the tp=1 problem; efficiency = t(1) / t(tp).
Layers: "column" (ColumnParallelLinear 1280 -> F: its backward all-reduces the input gradient), "row"
(RowParallelLinear F -> 1280: its forward all-reduces the output) and "mlp" (column then row, no GELU so
the column layer can take the overlapped path). Column layers run with overlap=False (synchronous
all-reduce after the input-gradient GEMM) and overlap=True (all-reduce launched async and hidden behind the
weight-gradient GEMM); the row layer has no overlap option.
Communication share: each case is timed twice, with the TP group and with a one-rank group holding the same
shards (every collective is then the identity): comm_ms = t_with - t_without, comm_share = comm_ms / t_with
(0 at tp=1, where both are the same code).
allreduce_ms is one all-reduce of the [tokens, 1280] activation alone, for scale. Times are the median over
`--iters` of the slowest rank (CUDA events on GPU).
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.measure import time_ms
from fused_kernels import get_ops
from parallel.layers import ColumnParallelLinear, RowParallelLinear
from tools.common import device_tag, tag_line, torchrun, write_csv

LAYERS = ("column", "row", "mlp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="rows of the activation (batch x sequence)")
    p.add_argument("--hidden", type=int, default=1280, help="model width (replicated features)")
    p.add_argument("--ffn", type=int, default=5120, help="split features at tp=1 (MLP width)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="GPU only; CPU runs use fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--out", default="benchmarks/results/tp_scaling")
    p.add_argument("--nprocs", type=int, nargs="+", default=None,
                   help="launch torchrun with each of these process counts, then merge")
    p.add_argument("--merge", action="store_true", help="only merge the per-tp CSVs in --out")
    return p.parse_args(argv)


def _slowest(ms: float, device: torch.device) -> float:
    t = torch.tensor(ms, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _median_ms(fn, args: argparse.Namespace, device: torch.device) -> float:
    dist.barrier()
    return _slowest(statistics.median(time_ms(fn, args.iters, args.warmup, device)), device)


def make_layers(layer: str, hidden: int, local_ffn: int, group: dist.ProcessGroup, overlap: bool,
                dtype: torch.dtype, device: torch.device) -> list[torch.nn.Module]:
    """This rank's shards (random: timing does not depend on values) wrapped in our TP layers."""
    ops = get_ops("none")
    kw = dict(dtype=dtype, device=device)
    column = ColumnParallelLinear(torch.randn(local_ffn, hidden, **kw) * 0.02, torch.zeros(local_ffn, **kw), ops,
                                  group, overlap=overlap)
    row = RowParallelLinear(torch.randn(hidden, local_ffn, **kw) * 0.02, torch.zeros(hidden, **kw), ops, group)
    return {"column": [column], "row": [row], "mlp": [column, row]}[layer]


def measure(args: argparse.Namespace, scaling: str, layer: str, overlap: bool | None,
            groups: dict[str, dist.ProcessGroup | None], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    tp = dist.get_world_size()
    ffn = args.ffn * (tp if scaling == "weak" else 1)  # global split features
    if ffn % tp:
        raise ValueError(f"--ffn {args.ffn} must be divisible by the tp size {tp}")
    local_ffn = ffn // tp
    in_features = local_ffn if layer == "row" else args.hidden
    x = torch.randn(1, args.tokens, in_features, dtype=dtype, device=device, requires_grad=True)  # [1, N, in]
    out_features = local_ffn if layer == "column" else args.hidden
    grad = torch.randn(1, args.tokens, out_features, dtype=dtype, device=device)  # [1, N, out]

    def timed(group: dist.ProcessGroup | None) -> float:
        torch.manual_seed(0)
        layers = make_layers(layer, args.hidden, local_ffn, group, bool(overlap), dtype, device)

        def step() -> None:
            y = x
            for m in layers:
                y = m(y)
            y.backward(grad)
            x.grad = None
            for m in layers:
                m.zero_grad(set_to_none=True)

        return _median_ms(step, args, device)

    with_comm = timed(groups["tp"])
    without = timed(groups["self"]) if tp > 1 else with_comm  # tp=1: the same one-rank code twice
    gemm_flops = 3 * 2 * args.tokens * args.hidden * local_ffn * (2 if layer == "mlp" else 1)  # fwd + 2 bwd GEMMs
    return {
        "tp": tp, "scaling": scaling, "layer": layer, "overlap": "n/a" if overlap is None else overlap,
        "tokens": args.tokens, "hidden": args.hidden, "ffn_global": ffn, "ffn_local": local_ffn,
        "dtype": str(dtype).removeprefix("torch."), "ms": round(with_comm, 4), "ms_no_comm": round(without, 4),
        "comm_ms": round(with_comm - without, 4), "comm_share": round((with_comm - without) / with_comm, 4),
        "tflops_per_rank": round(gemm_flops / with_comm / 1e9, 3),
    }


def allreduce_ms(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> float:
    buf = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device)  # [N, d], what each all-reduce moves
    return _median_ms(lambda: dist.all_reduce(buf), args, device)


def measure_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case on this world (run under torchrun; every rank calls it)."""
    use_cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if use_cuda and args.dtype == "bf16" else torch.float32
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    try:
        rank = dist.get_rank()
        self_group = None
        for r in range(dist.get_world_size()):  # new_group is collective: every rank creates every group
            g = dist.new_group([r])
            if r == rank:
                self_group = g
        groups = {"tp": dist.group.WORLD, "self": self_group}
        ar_ms = allreduce_ms(args, device, dtype)
        rows = []
        for scaling in ("strong", "weak"):
            for layer in LAYERS:
                for overlap in ((None,) if layer == "row" else (False, True)):
                    row = {**measure(args, scaling, layer, overlap, groups, device, dtype),
                           "allreduce_ms": round(ar_ms, 4)}
                    rows.append(row)
                    if rank == 0:
                        print(row, flush=True)
        if rank == 0:
            path = write_csv(Path(args.out) / f"tp_scaling_tp{dist.get_world_size()}.csv", rows, device_tag(device))
            print(f"wrote {path}")
        return rows
    finally:
        dist.destroy_process_group()


def merge(out: Path) -> list[dict[str, Any]]:
    """tp_scaling.csv: all tp_scaling_tp*.csv rows with speed-up / efficiency against tp=1, and the plots."""
    rows: list[dict[str, Any]] = []
    for path in sorted(out.glob("tp_scaling_tp*.csv")):
        rows += list(csv.DictReader(path.open()))
    if not rows:
        raise FileNotFoundError(f"no tp_scaling_tp*.csv in {out}")
    base = {(r["scaling"], r["layer"], r["overlap"]): float(r["ms"]) for r in rows if r["tp"] == "1"}
    for r in rows:
        t1 = base.get((r["scaling"], r["layer"], r["overlap"]))
        tp, ms = int(r["tp"]), float(r["ms"])
        speedup = None if t1 is None else t1 / ms
        r["speedup"] = None if speedup is None else round(speedup, 3)
        r["efficiency"] = None if speedup is None else round(speedup / tp if r["scaling"] == "strong" else speedup, 3)
    rows.sort(key=lambda r: (r["scaling"], r["layer"], r["overlap"], int(r["tp"])))
    write_csv(out / "tp_scaling.csv", rows)
    plot(rows, out)
    return rows


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = tag_line(rows[0]) if "device" in rows[0] else ""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    series = sorted({(r["layer"], r["overlap"]) for r in rows})
    for (layer, overlap) in series:
        label = layer + ("" if overlap == "n/a" else f", overlap={overlap}")
        for ax, scaling, key in ((axes[0], "strong", "speedup"), (axes[1], "weak", "efficiency")):
            pts = [(int(r["tp"]), r[key]) for r in rows
                   if (r["scaling"], r["layer"], r["overlap"]) == (scaling, layer, overlap) and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
    tps = sorted({int(r["tp"]) for r in rows})
    axes[0].plot(tps, tps, "k--", lw=0.8, label="ideal")
    axes[0].set(xlabel="TP ranks", ylabel="speed-up vs tp=1", title="strong scaling (fixed problem)")
    axes[1].axhline(1.0, color="k", ls="--", lw=0.8)
    axes[1].set(xlabel="TP ranks", ylabel="t(1) / t(tp)", title="weak scaling (fixed work per rank)")
    strong = [r for r in rows if r["scaling"] == "strong"]
    labels = [f"{r['layer']}{'' if r['overlap'] == 'n/a' else ' ov' if r['overlap'] == 'True' else ' sync'} "
              f"tp{r['tp']}" for r in strong]
    axes[2].barh(labels, [100 * float(r["comm_share"]) for r in strong])
    axes[2].invert_yaxis()
    axes[2].tick_params(axis="y", labelsize=7)
    axes[2].set(xlabel="% of layer time in (non-overlapped) communication", title="communication share, strong")
    for ax in axes[:2]:
        ax.set_xticks(tps)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "tp_scaling.png", dpi=120)
    plt.close(fig)


def launch_all(args: argparse.Namespace, argv: list[str]) -> None:
    """One torchrun per process count (the same flags minus --nprocs), then the merge."""
    passthrough, skip = [], False
    for a in argv:
        if skip and not a.startswith("--"):
            continue
        skip = a == "--nprocs" or a.startswith("--nprocs=")
        if not skip:
            passthrough.append(a)
    for n in args.nprocs:
        cmd = [*torchrun(n), "-m", "benchmarks.tp_scaling", *passthrough]
        print("$ " + shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[1])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out = Path(args.out)
    if args.nprocs:
        launch_all(args, argv)
    elif not args.merge:
        measure_all(args)
        return
    for r in merge(out):
        print({k: r[k] for k in ("tp", "scaling", "layer", "overlap", "ms", "comm_share", "speedup", "efficiency")})
    print(f"wrote {out / 'tp_scaling.csv'} and {out / 'tp_scaling.png'}")


if __name__ == "__main__":
    main()
