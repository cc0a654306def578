"""Standalone repro: DeepSpeed's ZeRO step costs host time per parameter tensor, with nobody to talk to.

Trains a stack of L tiny Linear layers (2L parameter tensors, almost no arithmetic) at world size 1 for each
engine: plain torch (AdamW), torch DDP, and DeepSpeed ZeRO-1/2/3 with the harness's zero{1,2,3}.json.
The fastest step time of --steps (another process on the host only ever adds time; results before `0a80300` took
the median) against the number of parameter tensors is close to a line; its slope is the host time each engine
spends per parameter tensor per step. GPT-2 Large has 436 parameter tensors, so slope x 436 is the host
time per step that engine's per-tensor work costs at GPT-2 Large (torch's own included; on a GPU, the device's work
can overlap it, so the wall time added depends on the batch). For ZeRO-3 this is the per-parameter Python path that
the ZeRO-3 profiles name (gradient bucketing, partition and free, gathers, per-parameter norms): the persistence
threshold is 0, as the harness sets it (gpt2/config/deepspeed_file.py), so every tensor is partitioned and gathered
although these are tiny.

    python -m benchmarks.repro.deepspeed_host_cost_per_tensor                   # GPU if present, else CPU (gloo)
    python -m benchmarks.repro.deepspeed_host_cost_per_tensor --layers 8 32 --steps 6 --out /tmp/hc

fp32, no communication partner, no overlap to hide anything: the numbers are the host's, and they depend on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.measure import report_table, time_ms  # noqa: E402
from gpt2.config.deepspeed_file import DS_CONFIG_DIR, persistence_threshold_default  # noqa: E402
from gpt2.config.schema import ParallelConfig  # noqa: E402
from gpt2.engines.deepspeed_engine import import_deepspeed  # noqa: E402
from gpt2.runtime.distributed import run_as_process  # noqa: E402
from tools.common import free_port  # noqa: E402

ENGINES = ("torch", "ddp", "zero1", "zero2", "zero3")
GPT2_LARGE_TENSORS = 436  # 36 blocks x 12 (4 Linear weights + 4 biases, 2 LayerNorms x 2) + wte, wpe, ln_f x 2
WIDTH = 32
MICRO_BATCH = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[16, 64, 256],
                   help="Linear layers per model (2 tensors each)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--steps", type=int, default=20, help="timed steps per point (after 3 warm-up steps)")
    p.add_argument("--out", type=Path, help="folder for host_cost.csv and host_cost.md")
    return p.parse_args(argv)


def ds_config(stage: int) -> dict:
    """The harness's zero{stage}.json as the 4-GPU runs use it, fp32 (its fp16 section tunes a recipe not used here)."""
    cfg = json.loads((DS_CONFIG_DIR / f"zero{stage}.json").read_text())
    cfg.pop("fp16", None)
    if stage == 3:  # the harness's default (per-block gathers: 0): no parameter stays whole, however small
        cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold",
                                            persistence_threshold_default(ParallelConfig().zero3_fetch))
    cfg.update(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1, gradient_clipping=1.0)
    return cfg


def make_step(engine: str, layers: int, device: torch.device) -> Callable[[], None]:
    """One training step of `engine` over a fresh stack of `layers` Linear layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    x = torch.randn(MICRO_BATCH, WIDTH, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if engine.startswith("zero"):
        ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(int(engine[-1])))

        def ds_step() -> None:
            ds.backward(ds(x).pow(2).mean())
            ds.step()
        return ds_step
    net = torch.nn.parallel.DistributedDataParallel(model) if engine == "ddp" else model

    def torch_step() -> None:
        net(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return torch_step


def init_single_process() -> torch.device:
    """World size 1, as torchrun would set it up for one process."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # deepspeed.comm over that group, as train.py makes it: on CPU without JIT-building DeepSpeed's shared-memory
    # all-reduce op (only its inference all-reduce uses it; 30+ s to compile on a machine without a build cache)
    import_deepspeed(device)
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = init_single_process()
    points: dict[str, list[tuple[int, float]]] = {}
    for engine in args.engines:
        for layers in args.layers:
            ms = min(time_ms(make_step(engine, layers, device), args.steps, warmup=3, device=device))
            points.setdefault(engine, []).append((2 * layers, ms))
            print(f"{engine:6} {2 * layers:5} tensors: {ms:8.2f} ms/step", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    rows = []
    for engine, pts in points.items():
        slope, intercept = statistics.linear_regression([t for t, _ in pts], [ms for _, ms in pts])
        rows.append({"engine": engine, **{f"ms_at_{t}_tensors": round(ms, 3) for t, ms in pts},
                     "us_per_tensor_per_step": round(1000 * slope, 1), "intercept_ms": round(intercept, 2),
                     "ms_per_step_at_gpt2_large_tensors": round(slope * GPT2_LARGE_TENSORS, 1)})
    report_table(f"Host time per parameter tensor per step, world size 1 ({name}, torch {torch.__version__}, "
                 f"DeepSpeed {deepspeed.__version__})", "python -m benchmarks.repro.deepspeed_host_cost_per_tensor "
                 + " ".join(sys.argv[1:] if argv is None else argv), rows, list(rows[0]), out=args.out,
                 stem="host_cost", tag={"device": name})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_as_process(main)
