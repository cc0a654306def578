"""Standalone repro: with fp32 weights (torch_autocast, or fp32 training), DeepSpeed ZeRO keeps a second fp32 copy.

Trains a stack of Linear layers at world size 1 for each engine (plain torch AdamW, and DeepSpeed ZeRO-1/2/3 with
the harness's zero{1,2,3}.json plus DeepSpeed's `torch_autocast` section, as `--zero-precision autocast`
runs them), then lists the tensor storages the engine made that are alive between steps, named by the attribute that
holds them, in units of the model's fp32 size. (Python's garbage collector lists them, so tensors that only C++ holds
are not seen: DDP's gradient buckets, for one, which is why DDP is not an engine here.)

What it shows (DeepSpeed 0.19.8):
- torch keeps 3 model-sized copies: the weights and Adam's two moments.
- ZeRO-1/2 keep 4: `single_partition_of_fp32_groups`, the fp32 master partition, is a clone of the weights' own
  fp32 partition (`bit16_groups_flat`), although both are fp32 and equal after every step.
- ZeRO-3 keeps 5 plus a reduce bucket: the weights' partitions (`fp16_partitioned_groups_flat`, fp32 here), a clone
  of them as the master (`fp32_partitioned_groups_flat`), and the flat fp32 gradient partition
  (`grad_partitions_flat_buffer`). DeepSpeed's `_create_fp32_partitions` means to share the weights when their dtype
  is the master's ("When torch autocast is enabled ... we don't need another copy of the weights"), but its test
  compares `tensor.device` (a torch.device) with `self.device`, which is `get_accelerator().current_device_name()`,
  a str; `torch.device("cuda", 0) == "cuda:0"` is False, so it clones.
At N ranks each of these copies is 1/N of the model per rank (ZeRO-1/2/3 partition them), the reduce bucket is not.
This is DeepSpeed as shipped; the harness runs ZeRO-3's sharing test with a torch.device
(`gpt2.engines.deepspeed_engine.zero3_master_shares_fp32_weights`), so its ZeRO-3 keeps 4 copies.

    python -m benchmarks.repro.deepspeed_master_weight_copies              # GPU if present, else CPU (gloo)
    python -m benchmarks.repro.deepspeed_master_weight_copies --out /tmp/copies
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.measure import report_table  # noqa: E402
from benchmarks.repro.deepspeed_host_cost_per_tensor import MICRO_BATCH, init_single_process  # noqa: E402
from benchmarks.repro.deepspeed_host_cost_per_tensor import ds_config as host_cost_ds_config  # noqa: E402
from gpt2.runtime.distributed import run_as_process  # noqa: E402

ENGINES = ("torch", "zero1", "zero2", "zero3")
# the attributes of DeepSpeed's ZeRO optimizers (stage3.py, stage_1_and_2.py) that hold model-sized buffers
ZERO_BUFFERS = ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer",
                "ipg_buckets", "bit16_groups_flat", "single_partition_of_fp32_groups")
WIDTH = 512


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help=f"Linear({WIDTH}, {WIDTH}) layers")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--out", type=Path, help="folder for copies.csv and copies.md")
    return p.parse_args(argv)


def ds_config(stage: int) -> dict[str, Any]:
    """The host-cost repro's config (the harness's zero{stage}.json as the 4-GPU runs use it) with DeepSpeed's
    torch_autocast (fp32 weights), as gpt2.config.deepspeed_file writes it for `--zero-precision autocast`."""
    return {**host_cost_ds_config(stage), "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


def _storages(value: object, name: str, out: dict[int, str]) -> None:
    """Name the storage of every tensor reachable from `value` (lists, dicts, bucket objects) by `name`."""
    if isinstance(value, torch.Tensor):
        if value.untyped_storage().nbytes():
            out.setdefault(value.untyped_storage().data_ptr(), name)
    elif isinstance(value, dict):
        for v in value.values():
            _storages(v, name, out)
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        for v in value:
            _storages(v, name, out)
    elif hasattr(value, "buffer"):  # a ZeRO-3 reduce bucket
        _storages(value.buffer, name, out)


def master_shares_weights(zero: Any) -> dict[str, object]:
    """Whether the fp32 master partition is the weights' own storage, and (ZeRO-3) the device test that decides it
    in DeepSpeed's `_create_fp32_partitions`: `weights.device == self.device`."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # stage 3
        weights, master = zero.fp16_partitioned_groups_flat[0], zero.fp32_partitioned_groups_flat[0]
        test = f"{weights.device!r} == {zero.device!r} -> {weights.device == zero.device}"
    else:  # stages 1 and 2: no test, always a clone
        weights, master, test = zero.bit16_groups_flat[0], zero.single_partition_of_fp32_groups[0], "none (clones)"
    same = weights.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
    return {"master_dtype": str(master.dtype).removeprefix("torch."), "weights_dtype": str(weights.dtype).removeprefix(
        "torch."), "master_shares_weights": same, "deepspeed_share_test": test}


def live_storages(device: torch.device) -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage alive on `device`."""
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device.type and obj.untyped_storage().nbytes():
            found.setdefault(obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes())
    return found


def census(engine: str, layers: int, device: torch.device) -> dict[str, object]:
    """Train `engine` for 2 steps, then: MiB held per named buffer, and the total in model-sized fp32 copies."""
    gc.collect()
    before = set(live_storages(device))  # earlier engines' leftovers are not this engine's
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    x = torch.randn(MICRO_BATCH, WIDTH, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    names: dict[int, str] = {}
    master: dict[str, object] = {}
    if engine.startswith("zero"):
        ds, zero, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(int(engine[-1])))
        for _ in range(2):
            ds.backward(ds(x).pow(2).mean())
            ds.step()
        for attr in ZERO_BUFFERS:
            if hasattr(zero, attr):
                _storages(getattr(zero, attr), attr, names)
        master = master_shares_weights(zero)
        del ds, zero
    else:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    _storages(optimizer.state, "AdamW moments", names)  # ZeRO steps our optimizer over its flat partitions
    _storages([p.data for p in model.parameters()], "module parameters", names)
    held: dict[str, float] = {}
    for ptr, nbytes in live_storages(device).items():
        if ptr not in before and ptr != x.untyped_storage().data_ptr():  # the input aside
            name = names.get(ptr, "unnamed")
            held[name] = held.get(name, 0.0) + nbytes
    total = sum(held.values())
    row = {"engine": engine, "model_fp32_mib": round(model_bytes / 2**20, 2), "held_mib": round(total / 2**20, 2),
           "model_sized_copies": round((total - held.get("ipg_buckets", 0.0)) / model_bytes, 2)}
    row.update(master)
    row.update({f"{k} (MiB)": round(v / 2**20, 2) for k, v in sorted(held.items())})
    del model, optimizer
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = init_single_process()
    rows = [census(engine, args.layers, device) for engine in args.engines]
    for row in rows:
        print(f"{row['engine']:6} {row['model_sized_copies']:5.2f} model-sized copies besides reduce buckets: "
              + ", ".join(f"{k} {v}" for k, v in row.items() if k.endswith("(MiB)")), flush=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report_table(f"Device memory held between steps, world size 1 ({name}, torch {torch.__version__}, DeepSpeed "
                 f"{deepspeed.__version__})", "python -m benchmarks.repro.deepspeed_master_weight_copies "
                 + " ".join(sys.argv[1:] if argv is None else argv), rows, columns, out=args.out, stem="copies",
                 tag={"device": name})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_as_process(main)
