"""The DeepSpeed config of a `--mode hybrid` run: ds_configs/zero{stage}.json (or --ds-config) + our CLI values.

Our CLI stays the single source of truth: batch size, gradient accumulation, clipping, precision and ZeRO stage
(and the two checks the non-finite guard relies on) are written into the DeepSpeed config, and a JSON file that
sets one of them to another value is an error naming both. Needs no DeepSpeed import (train.py checks the config
before any work; the planner reads its ZeRO settings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpt2.config import ConfigError

if TYPE_CHECKING:
    from gpt2.layout import RunLayout

DS_CONFIG_DIR = Path(__file__).resolve().parent.parent / "ds_configs"


def default_ds_config_path(zero_stage: int) -> Path:
    return DS_CONFIG_DIR / f"zero{zero_stage}.json"


def persistence_threshold_default(zero3_fetch: str) -> int:
    """ZeRO-3's `stage3_param_persistence_threshold` where the DeepSpeed JSON leaves it out. Per-block gathers: 0,
    so a block's LayerNorms and biases travel in its one coalesced all-gather; persistent (unpartitioned) ones
    would instead be re-gathered after every optimizer step with one blocking all-gather each (DeepSpeed's
    `_post_step`: ~290 for GPT-2 Large; 1.8x steps/s on a 2-rank CPU proxy without them). Per-module hooks:
    DeepSpeed's own 1e5, which spares those hooks a gather per small module."""
    return 0 if zero3_fetch == "block" else 100_000


def _harness_values(layout: RunLayout) -> list[tuple[tuple[str, ...], Any, str]]:
    """(key path, our value, the flag that sets it) for every DeepSpeed key the CLI owns."""
    cfg, t, accum, dp_size = layout.cfg, layout.cfg.train, layout.grad_accum, layout.dp_size
    return [
        (("train_micro_batch_size_per_gpu",), t.batch_size, f"--batch-size is {t.batch_size}"),
        (("gradient_accumulation_steps",), accum, f"--grad-accum is {accum}"),
        (("train_batch_size",), t.batch_size * accum * dp_size,
         f"--batch-size x --grad-accum x dp-size is {t.batch_size} x {accum} x {dp_size} = "
         f"{t.batch_size * accum * dp_size}"),
        (("gradient_clipping",), float(t.grad_clip), f"--grad-clip is {t.grad_clip}"),
        (("zero_optimization", "stage"), cfg.parallel.zero_stage, f"--zero-stage is {cfg.parallel.zero_stage}"),
        (("bf16", "enabled"), t.precision == "bf16", f"--precision is {t.precision}"),
        (("fp16", "enabled"), t.precision == "fp16", f"--precision is {t.precision}"),
        # the non-finite guard (gpt2.guard) relies on DeepSpeed skipping every step whose global gradient norm is
        # not finite: bf16 ZeRO-1/2 skips only with this check on, and the norm must be computed
        (("bf16", "check_grad_overflow"), True, "the non-finite guard needs DeepSpeed to skip a step whose gradient "
                                                "norm is not finite"),
        (("zero_optimization", "compute_grad_norm"), True, "the non-finite guard reads the global gradient norm"),
    ]


def build_ds_config(layout: RunLayout) -> dict[str, Any]:
    """The DeepSpeed config: the JSON file (--ds-config, else ds_configs/zero{stage}.json) + our CLI values.

    A file value that disagrees with the CLI is a ConfigError naming both; optimizer and scheduler
    sections are rejected (we pass our own objects). CPU runs are fp32 whatever --precision says.
    """
    cfg = layout.cfg
    path = layout.ds_config_path
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
    for keys, ours, flag in _harness_values(layout):
        node = ds
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if keys[-1] in node and node[keys[-1]] != ours:
            raise ConfigError(f"{path} sets {'.'.join(keys)}={json.dumps(node[keys[-1]])} but {flag}; "
                              "make them agree or drop the key from the file (the command line sets it)")
        node[keys[-1]] = ours
    if cfg.parallel.zero_stage == 3:
        zero = ds["zero_optimization"]
        zero.setdefault("stage3_param_persistence_threshold", persistence_threshold_default(cfg.parallel.zero3_fetch))
        # DeepSpeed's default (true) makes zero.Init replace torch.nn.functional.linear process-wide by its
        # autograd.Function LinearFunctionForZeroStage3. Traced by Dynamo (torch 2.11, CUDA, any backend) it returns
        # zero weight and bias gradients (benchmarks/repro/deepspeed_zero3_linear_compile.py): under --compile the
        # blocks' and the head's Linears stopped learning (GPT-2, 4 layers: 8.28 after 15 steps where single reaches
        # 6.08). With false the model calls torch's linear like every other mode, and eager and compiled ZeRO-3
        # match single within 0.01; the saving it offers is moot here, a block's weights are re-gathered before
        # its backward either way.
        zero.setdefault("memory_efficient_linear", False)
        if zero["memory_efficient_linear"] and cfg.train.compile:
            raise ConfigError(f"{path} sets zero_optimization.memory_efficient_linear=true, which trains the wrong "
                              "function under --compile (DeepSpeed's linear loses its weight gradients in the "
                              "compiled graph); drop the key or set it to false")
    # the precision that runs (the layout's: CPU runs are fp32 whatever --precision says)
    ds["bf16"]["enabled"], ds["fp16"]["enabled"] = layout.precision == "bf16", layout.precision == "fp16"
    ds["zero_allow_untested_optimizer"] = True  # torch AdamW: DeepSpeed only "tests" its own optimizers
    return ds
