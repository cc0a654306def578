"""The DeepSpeed config of a `--mode hybrid` run, in one module: which JSON file, the keys our flags own, the checks
that the file agrees with them, and the config built from it.

Our CLI stays the single source of truth: batch size, gradient accumulation, clipping, precision and ZeRO stage
(and the two checks the non-finite guard relies on) are ours, and a file that sets one of them to another value is
an error naming both. `RunLayout.resolve` reads and checks the file once (so train.py, `--plan` and
slurm/preflight.py all refuse a broken one before any work); `build_ds_config` builds DeepSpeed's config from what
it read (the engine's only call), and the planner reads its ZeRO settings. Needs no DeepSpeed import. The default
files are package data (ds_configs/ beside this module), so an installed harness finds them too.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from gpt2.config.schema import ConfigError, ParallelConfig, RunConfig

DS_CONFIG_DIR = Path(__file__).resolve().with_name("ds_configs")
# DeepSpeed's `lower_precision_safe_modules` under torch_autocast: every matmul module (gpt2.runtime.flat_blocks's
# MATMUL_TYPES) and the holder of their flat tensors under --zero3-fetch flat. Names, as DeepSpeed takes them: this
# package sits below the model's (tests/unit/test_flat_blocks.py checks them against the classes).
LOWER_PRECISION_MODULES = ("gpt2.model.gpt.Linear", "parallel.layers.ColumnParallelLinear",
                           "parallel.layers.RowParallelLinear", "gpt2.runtime.flat_blocks.MatmulFlatParams")


def ds_config_file(p: ParallelConfig) -> Path:
    """The DeepSpeed JSON a hybrid run reads: --ds-config, else the package's ds_configs/zero{--zero-stage}.json."""
    return Path(p.ds_config) if p.ds_config else DS_CONFIG_DIR / f"zero{p.zero_stage}.json"


def persistence_threshold_default(zero3_fetch: str) -> int:
    """ZeRO-3's `stage3_param_persistence_threshold` where the DeepSpeed JSON leaves it out. Per-block gathers (block,
    flat): 0, so a block's LayerNorms and biases travel in its one coalesced all-gather; persistent (unpartitioned) ones
    would instead be re-gathered after every optimizer step with one blocking all-gather each (DeepSpeed's
    `_post_step`: ~290 for GPT-2 Large; docs/decisions.md). Per-module hooks:
    DeepSpeed's own 1e5, which spares those hooks a gather per small module."""
    return 100_000 if zero3_fetch == "module" else 0


def throughput_timer_defaults() -> dict[str, Any]:
    """DeepSpeed's `timers.throughput` section where the DeepSpeed JSON has none (a section in the file is used as it
    is): off. DeepSpeed's default timer (enabled, `synchronized`) synchronizes the device at every micro-batch's
    forward and every `engine.step()` call, once a micro-batch (deepspeed/utils/timer.py, ThroughputTimer, from the
    third step on), so the host cannot queue the next work while the device runs, which host-bound steps pay for
    (docs/decisions.md). Our metrics time the steps themselves (`gpt2.observe.metrics`), so nothing reads it."""
    return {"enabled": False}


def zero3_defaults(zero3_fetch: str) -> dict[str, Any]:
    """The zero_optimization keys a ZeRO-3 run gets where its file leaves them out (a value in the file wins): the
    persistence threshold above, and DeepSpeed's memory-efficient linear off. DeepSpeed's default (true) makes
    zero.Init replace torch.nn.functional.linear process-wide by its autograd.Function
    LinearFunctionForZeroStage3. Traced by Dynamo (torch 2.11, CUDA, any backend) it returns zero weight and bias
    gradients (benchmarks/repro/deepspeed_zero3_linear_compile.py): under --compile the blocks' and the head's
    Linears stopped learning (GPT-2, 4 layers: 8.28 after 15 steps where single reaches 6.08). With false the model
    calls torch's linear like every other mode, and eager and compiled ZeRO-3 match single within 0.01; the saving
    it offers is moot here, a block's weights are re-gathered before its backward either way. DeepCompile keeps the
    per-block threshold (0): every parameter is partitioned by zero.Init, and DeepCompile marks each non-persistent
    anyway (deepspeed/compile/init_z3.py, `ds_persist`)."""
    return {"stage3_param_persistence_threshold": persistence_threshold_default(zero3_fetch),
            "memory_efficient_linear": False}


def precision_values(precision: str, recipe: str) -> dict[tuple[str, ...], Any]:
    """DeepSpeed's mixed-precision keys for `precision` (bf16 | fp16 | fp32) and --zero-precision `recipe`.

    autocast: DeepSpeed's torch_autocast section, the recipe of single and DDP: fp32 weights (partitions, master
    copy and gradients), the forward under torch.autocast, so a Linear's matmul sees the same bf16-rounded weight as
    in single. deepspeed: its bf16/fp16 section, a 16-bit model (weights, residual stream and LayerNorms in 16
    bits) stepped from fp32 master weights: another function, whose losses drift from single's well beyond
    single's own run-to-run noise (docs/decisions.md), so it is not the default."""
    autocast = recipe == "autocast" and precision != "fp32"
    values: dict[tuple[str, ...], Any] = {
        ("bf16", "enabled"): recipe == "deepspeed" and precision == "bf16",
        ("fp16", "enabled"): recipe == "deepspeed" and precision == "fp16",
        ("torch_autocast", "enabled"): autocast,
    }
    if autocast:
        values["torch_autocast", "dtype"] = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    return values


def harness_values(cfg: RunConfig, grad_accum: int, dp_size: int,
                   deepcompile: bool) -> list[tuple[tuple[str, ...], Any, str]]:
    """(key path, our value, the flag that sets it) for every DeepSpeed key the CLI owns."""
    t = cfg.train
    return [
        (("train_micro_batch_size_per_gpu",), t.batch_size, f"--batch-size is {t.batch_size}"),
        (("gradient_accumulation_steps",), grad_accum, f"--grad-accum is {grad_accum}"),
        (("train_batch_size",), t.batch_size * grad_accum * dp_size,
         f"--batch-size x --grad-accum x dp-size is {t.batch_size} x {grad_accum} x {dp_size} = "
         f"{t.batch_size * grad_accum * dp_size}"),
        (("gradient_clipping",), float(t.grad_clip), f"--grad-clip is {t.grad_clip}"),
        (("zero_optimization", "stage"), cfg.parallel.zero_stage, f"--zero-stage is {cfg.parallel.zero_stage}"),
        *[(keys, value, f"--precision is {t.precision} with --zero-precision {cfg.parallel.zero_precision}")
          for keys, value in precision_values(t.precision, cfg.parallel.zero_precision).items()],
        # the non-finite guard (gpt2.engines.guard) relies on DeepSpeed skipping every step whose global gradient
        # norm is not finite: ZeRO-1/2 over DeepSpeed's bf16 model (--zero-precision deepspeed) skips only with this
        # check on (over fp32 weights, torch_autocast, it checks the norm anyway), and the norm must be computed
        (("bf16", "check_grad_overflow"), True, "the non-finite guard needs DeepSpeed to skip a step whose gradient "
                                                "norm is not finite"),
        (("zero_optimization", "compute_grad_norm"), True, "the non-finite guard reads the global gradient norm"),
        # DeepCompile (ZeRO-3): DeepSpeed reads compile.deepcompile in initialize(); engine.compile() then applies it
        (("compile", "deepcompile"), deepcompile,
         "--compile --compiler deepcompile " + ("is given" if deepcompile else "is not given")),
    ]


def read_ds_file(cfg: RunConfig, grad_accum: int, dp_size: int, deepcompile: bool) -> dict[str, Any]:
    """The hybrid run's DeepSpeed file, parsed and checked against the flags: it must exist and be JSON, carry no
    optimizer or scheduler (we pass our own), agree with every key the CLI owns, and not turn on DeepSpeed's
    memory-efficient linear under --compile."""
    path = ds_config_file(cfg.parallel)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} does not exist; pass an existing file to --ds-config")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {err}") from err
    for section in ("optimizer", "scheduler"):
        if section in ds:
            raise ConfigError(f"{path} has a {section!r} section; remove it: the optimizer (AdamW) and LR schedule "
                              "come from the command line (--lr, --min-lr, --warmup-steps, --weight-decay)")
    for keys, ours, flag in harness_values(cfg, grad_accum, dp_size, deepcompile):
        node: Any = ds
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                break
            node = node[k]
        else:
            if node != ours:
                raise ConfigError(f"{path} sets {'.'.join(keys)}={json.dumps(node)} but {flag}; "
                                  "make them agree or drop the key from the file (the command line sets it)")
    # DeepSpeed's memory-efficient linear (its default; off unless the file asks: zero3_defaults) traced by Dynamo
    # loses its weight gradients
    if cfg.zero_stage == 3 and ds.get("zero_optimization", {}).get("memory_efficient_linear") and cfg.train.compile:
        raise ConfigError(f"{path} sets zero_optimization.memory_efficient_linear=true, which trains the wrong "
                          "function under --compile (DeepSpeed's linear loses its weight gradients in the "
                          "compiled graph); drop the key or set it to false")
    return ds


class DeepSpeedLayout(Protocol):
    """What `build_ds_config` reads of a run's `gpt2.config.layout.RunLayout` (which imports this module)."""

    cfg: RunConfig
    ds_file: Mapping[str, Any] | None
    grad_accum: int
    dp_size: int
    deepcompile: bool
    zero_stage: int | None
    precision: str


def build_ds_config(layout: DeepSpeedLayout) -> dict[str, Any]:
    """The DeepSpeed config: the run's file + our CLI values (which the layout checked it agrees with), ZeRO-3's and
    the throughput timer's defaults where the file leaves them out, and the precision that runs (CPU runs are fp32
    whatever --precision says)."""
    assert layout.ds_file is not None, "a hybrid run's layout carries its DeepSpeed file"
    cfg = layout.cfg
    ds = copy.deepcopy(dict(layout.ds_file))
    for keys, ours, _ in harness_values(cfg, layout.grad_accum, layout.dp_size, layout.deepcompile):
        node = ds
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = ours
    if layout.zero_stage == 3:
        ds["zero_optimization"] = {**zero3_defaults(cfg.parallel.zero3_fetch), **ds["zero_optimization"]}
    ds.setdefault("timers", {}).setdefault("throughput", throughput_timer_defaults())
    # the precision that runs (the layout's: CPU runs are fp32 whatever --precision says)
    for (section, key), value in precision_values(layout.precision, cfg.parallel.zero_precision).items():
        ds.setdefault(section, {})[key] = value
    if ds["torch_autocast"]["enabled"]:
        ds["torch_autocast"].setdefault("lower_precision_safe_modules", list(LOWER_PRECISION_MODULES))
    ds["zero_allow_untested_optimizer"] = True  # torch AdamW: DeepSpeed only "tests" its own optimizers
    return ds
