"""Prototype: DeepSpeed ZeRO-3 with one flat parameter per transformer block and weight-decay group, against today's
per-tensor parameters: the host time of a step and whether both train the same function.

DeepSpeed's ZeRO-3 host work is per parameter tensor (benchmarks/repro/deepspeed_host_cost_per_tensor.py;
benchmarks/results/zero3/host_breakdown_cpu: fetch, release, gradient hooks, reduce-scatter and partition, the
per-tensor norms), so fewer, larger tensors should cut it. This trains the harness's GPT (`gpt2.model.gpt`,
gpt2-tiny widened to --n-layer blocks, batch 1 x 32 tokens, fp32: a step of mostly host work) under the harness's
ZeRO-3 (`gpt2.config.deepspeed_file.build_ds_config` over its zero3.json, each block a DeepSpeed leaf module as
`gpt2.runtime.parallelize` sets it, the engine's AdamW groups and its fp32-master sharing) in two variants:

    per_tensor  the model as the harness builds it: 12 tensors a block (GPT-2 Large: 436 in all)
    flat        each block's parameters copied into 2 flat Parameters, weights with decay and biases + LayerNorm
                parameters without (FlatBlock); its forward runs the original Block through
                torch.func.functional_call on views of the gathered flat tensors: 2 tensors a block (GPT-2 Large: 76)

Both are built from the same seed without `deepspeed.zero.Init` (the flat one must exist whole to be flattened),
live side by side and train on the same batches, their steps alternated (each first every other time) so that
another process on the host slows both alike; the losses of every step must agree within --atol or it fails. It
reports rank 0's fastest and median step of each over --steps timed steps (after --warmup), in wall time and in
the process's CPU time, the median of the paired ratios (flat / per_tensor, step by step), the parameter tensors
of each variant (the model's, and those DeepSpeed's ZeRO-3 optimizer partitions), and the gathered parameter
storage that the tensors saved for backward keep alive after the forward. No timing is asserted.

--compile: the harness's `--compile --compile-scope blocks` (`gpt2.runtime.compiling.compile_forwards`: each
Block's forward, hooks eager); the flat variant's FlatBlock then calls the compiled Block forward on its views.

    python -m benchmarks.repro.deepspeed_flat_block_params                  # launches 2 ranks (gloo, CPU)
    python -m benchmarks.repro.deepspeed_flat_block_params --n-layer 8 --steps 5 --out /tmp/flat

What the real feature would need, beyond this prototype:
- zero.Init: the harness builds ZeRO-3 models partitioned at construction, so no rank ever holds the whole model;
  flattening afterwards needs it whole. The flat Parameters would have to be created in the Block's constructor,
  each slice initialised there as its module does today (N(0, 0.02), the scaled residual projections, zero biases,
  LayerNorm ones; in the same RNG order, so a seed still draws today's weights), so zero.Init partitions them.
- Mixed precision: under DeepSpeed's torch_autocast, `lower_precision_safe_modules` (gpt2.config.deepspeed_file) marks
  the parameters *of Linear modules* to be gathered and reduced in bf16; flat tensors owned by the block are not
  marked, so they would travel in fp32 (twice the bytes). The split would be 3 per block (Linear weights: decay,
  bf16; Linear biases: no decay, bf16; LayerNorms: no decay, fp32), with the flat tensors marked by hand.
- Checkpoints and export: the state dict has `blocks.N.decay` / `blocks.N.no_decay` instead of the Hugging Face
  names that `gpt2.model.hf_weights` (--init-from) and the checkpoint tools read and write; a mapping both ways
  (names, offsets, shapes: FlatBlock's layout) at save, load and export, and DeepSpeed's zero_to_fp32 output too.
- Weight decay: the harness's `param_groups` decides by dimension (>= 2 decays); a flat tensor is 1-D, so the
  groups must name the flat decay tensors (here: `flat_param_groups`).
- Tensor parallelism: one flat tensor per block per weight-decay group *and* TP placement (column, row, replicated),
  since ZeRO reduces and norms them differently (`tensor_model_parallel`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.autograd.graph import saved_tensors_hooks  # noqa: E402
from torch.func import functional_call  # noqa: E402

from benchmarks.measure import report_table  # noqa: E402
from gpt2.config.cli import parse_args as parse_train_args  # noqa: E402
from gpt2.config.deepspeed_file import build_ds_config  # noqa: E402
from gpt2.config.layout import RunLayout  # noqa: E402
from gpt2.engines.deepspeed_engine import import_deepspeed, zero3_master_shares_fp32_weights  # noqa: E402
from gpt2.model.gpt import GPT, Block  # noqa: E402
from gpt2.runtime.distributed import DistContext, init_distributed, launched_by_launcher, run_as_process  # noqa: E402
from gpt2.runtime.parallelize import build_model, parallelize, param_groups  # noqa: E402
from parallel.mpu import ModelParallelUnit  # noqa: E402
from tools.common import torchrun  # noqa: E402

MODULE = "benchmarks.repro.deepspeed_flat_block_params"
VARIANTS = ("per_tensor", "flat")
SEQ_LEN = 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="processes torchrun launches (gloo on CPU)")
    p.add_argument("--n-layer", type=int, default=24, help="blocks of gpt2-tiny width (12 tensors each)")
    p.add_argument("--steps", type=int, default=30, help="timed steps of each variant, alternated")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each before them")
    p.add_argument("--atol", type=float, default=1e-6,
                   help="largest loss difference from per_tensor allowed (fp32: a wrong weight-decay group gave 2e-5)")
    p.add_argument("--compile", action="store_true", help="the harness's --compile --compile-scope blocks")
    p.add_argument("--out", type=Path, help="folder for flat_params.csv and flat_params.md")
    return p.parse_args(argv)


class FlatBlock(nn.Module):
    """A Block whose parameters live in 2 flat Parameters: `decay` (the matrices) and `no_decay` (biases and
    LayerNorm parameters), split as the harness's `param_groups` splits them (dim >= 2 decays). The Block keeps no
    parameter of its own, so DeepSpeed partitions, gathers and reduces the 2 flat tensors only; each forward runs
    the Block on views of them (views of the gathered tensors, after DeepSpeed's pre-forward hook)."""

    def __init__(self, block: Block):
        super().__init__()
        named = dict(block.named_parameters())
        self.shapes = {name: p.shape for name, p in named.items()}
        self.decay_names = [name for name, p in named.items() if p.dim() >= 2]
        self.no_decay_names = [name for name, p in named.items() if p.dim() < 2]
        with torch.no_grad():  # the same values: the flat model starts where the per-tensor one does
            self.decay = nn.Parameter(torch.cat([named[n].reshape(-1) for n in self.decay_names]))  # [sum numel]
            self.no_decay = nn.Parameter(torch.cat([named[n].reshape(-1) for n in self.no_decay_names]))
        for name in named:  # None, not kept: DeepSpeed would see (and partition) them too; functional_call fills them
            owner, _, attr = name.rpartition(".")
            block.get_submodule(owner).register_parameter(attr, None)
        self.block = block

    def views(self) -> dict[str, torch.Tensor]:
        """Each original parameter name -> a view of its slice of the flat tensors, in its original shape."""
        out: dict[str, torch.Tensor] = {}
        for flat, names in ((self.decay, self.decay_names), (self.no_decay, self.no_decay_names)):
            pieces = flat.split([self.shapes[n].numel() for n in names])  # 1-D views, in the order of the cat
            out.update({n: piece.view(self.shapes[n]) for n, piece in zip(names, pieces)})
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.block, self.views(), (x,))  # [B, T, d] -> [B, T, d]


def flatten_blocks(model: GPT) -> None:
    """Replace each Block by a FlatBlock around it, in place, and make the FlatBlocks the DeepSpeed leaf modules
    (one gather of both flat tensors in one hook, as the harness gathers a Block's 12)."""
    from deepspeed.utils import set_z3_leaf_modules

    model.blocks = nn.ModuleList(FlatBlock(block) for block in model.blocks)
    set_z3_leaf_modules(model, [FlatBlock])


def flat_param_groups(model: GPT, weight_decay: float) -> list[dict]:
    """The harness's `param_groups` with each block's 1-D `decay` tensor moved into the decay group."""
    decay, no_decay = param_groups(model, weight_decay)
    flat_decay = {id(block.decay): block.decay for block in model.blocks}
    decay["params"] = [*decay["params"], *flat_decay.values()]
    no_decay["params"] = [p for p in no_decay["params"] if id(p) not in flat_decay]
    return [decay, no_decay]


def batches(ctx: DistContext, vocab_size: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (input, target) batches of [1, SEQ_LEN] token ids, this rank's own, the same for every variant."""
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    tokens = torch.randint(vocab_size, (n, 1, SEQ_LEN + 1), generator=g)  # [n, 1, T + 1]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def keep(saved: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook that saves each tensor as itself (as without hooks) and lists it."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t
    return pack


def held_storage_bytes(saved: list[torch.Tensor]) -> int:
    """Bytes of gathered ZeRO-3 parameter storage that the tensors saved for backward hold after the forward, when
    DeepSpeed has released every gathered parameter (`param.data` = an empty tensor): none through a saved Parameter,
    whose data is empty again, the whole gathered buffer through a saved view of one (`weight.t()` in F.linear,
    FlatBlock's views), which keeps the old storage alive until backward."""
    storages = {}
    for t in saved:
        if hasattr(t if t._base is None else t._base, "ds_id"):  # a ZeRO-3 parameter or a view of one
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def make_step(variant: str, layout: RunLayout, ctx: DistContext, data: Iterator[tuple[torch.Tensor, torch.Tensor]],
              losses: list[float]) -> tuple[Callable[[list[torch.Tensor] | None], None], dict[str, int]]:
    """One ZeRO-3 training step of a fresh `variant` model (appending its loss to `losses`), and its tensor counts."""
    deepspeed = import_deepspeed(ctx.device)
    t = layout.cfg.train
    model = parallelize(build_model(layout, ctx.device, ctx.dims), layout, ctx.dims)
    if variant == "flat":
        flatten_blocks(model)
    groups = (flat_param_groups if variant == "flat" else param_groups)(model, t.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=True)  # as the engine's
    with zero3_master_shares_fp32_weights():
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=build_ds_config(layout),
                                          mpu=ModelParallelUnit(ctx.dims), dist_init_required=False)
    counts = {"tensors": len({id(p) for p in model.parameters()}),
              "zero3_tensors": sum(len(group) for group in engine.optimizer.fp16_groups)}

    def step(saved: list[torch.Tensor] | None = None) -> None:
        """With `saved`: also list the tensors the forward saves for backward (an untimed step only)."""
        x, y = next(data)
        with contextlib.nullcontext() if saved is None else saved_tensors_hooks(keep(saved), lambda t: t):
            loss, _ = engine(x, y)
        if saved is not None:
            counts["saved_gathered_kib"] = held_storage_bytes(saved) // 1024
            saved.clear()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return step, counts


def run_rank(args: argparse.Namespace) -> int:
    cfg = parse_train_args(["--mode", "hybrid", "--model", "gpt2-tiny", "--n-layer", str(args.n_layer),
                            "--batch-size", "1", "--seq-len", str(SEQ_LEN), "--device", "cpu",
                            *(["--compile", "--compile-scope", "blocks"] if args.compile else [])])
    layout, ctx = init_distributed(cfg)
    data = batches(ctx, cfg.model.vocab_size, args.warmup + args.steps)
    losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
    steps, counts = {}, {}
    for variant in VARIANTS:  # both alive at once, so their steps interleave
        steps[variant], counts[variant] = make_step(variant, layout, ctx, iter(data), losses[variant])
    for i in range(args.warmup):
        for variant in VARIANTS:
            steps[variant]([] if i == 0 else None)
    # wall: what the step takes; cpu: this process's CPU time in it (all its threads, gloo's included; not the
    # waits for the peer rank, nor time another process on the host takes from it)
    times: dict[str, dict[str, list[float]]] = {v: {"wall": [], "cpu": []} for v in VARIANTS}
    for i in range(args.steps):  # alternated, each first every other time: a busy host slows both alike
        for variant in VARIANTS[:: 1 if i % 2 == 0 else -1]:
            wall, cpu = time.perf_counter(), time.process_time()
            steps[variant]()
            times[variant]["cpu"].append(1e3 * (time.process_time() - cpu))
            times[variant]["wall"].append(1e3 * (time.perf_counter() - wall))
    reference = torch.tensor(losses["per_tensor"])  # [warmup + steps]
    diff = {v: (torch.tensor(run) - reference).abs().max().item() for v, run in losses.items()}
    worst = torch.tensor(max(diff.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank's batches, so every rank stops together
    if ctx.is_main:
        rows = []
        for v in VARIANTS:
            row: dict[str, object] = {"variant": v, **counts[v]}
            for kind, ms in times[v].items():
                base = times["per_tensor"][kind]
                row |= {f"best_{kind}_ms": round(min(ms), 1), f"median_{kind}_ms": round(statistics.median(ms), 1),
                        f"{kind}_paired_ratio": round(statistics.median(a / b for a, b in zip(ms, base)), 3)}
            rows.append({**row, "max_loss_diff_rank0": f"{diff[v]:.2e}"})
        report_table(f"ZeRO-3 step, per-tensor vs flat block parameters, {args.ranks} ranks (CPU, gloo, fp32, torch "
                     f"{torch.__version__}, DeepSpeed {import_deepspeed(ctx.device).__version__})",
                     shlex.join(["python", "-m", MODULE, *args.argv]), rows, list(rows[0]), out=args.out,
                     stem="flat_params", tag={"device": "cpu"})
        print(f"losses (per_tensor, rank 0): {[round(x, 4) for x in losses['per_tensor']]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if worst.item() > args.atol:
        raise RuntimeError(f"flat trains another function: a loss differs from per_tensor's by {worst.item():.3e} "
                           f"> --atol {args.atol}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Without a launcher: torchrun this module on --ranks processes. Launched: one rank's run."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv = argv
    if not launched_by_launcher():
        return subprocess.run([*torchrun(args.ranks), "-m", MODULE, *argv]).returncode
    return run_rank(args)


if __name__ == "__main__":
    run_as_process(main)
