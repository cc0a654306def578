"""The DeepSpeed config of a `--mode hybrid` run: the file `RunLayout.resolve` read and checked
(`gpt2.config.deepspeed_file`: ds_configs/zero{stage}.json or --ds-config) + our CLI values. Only builds: every
check on the file is the layout's, made before any work.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from gpt2.config.deepspeed_file import harness_values, precision_values, throughput_timer_defaults, zero3_defaults

if TYPE_CHECKING:
    from gpt2.config.layout import RunLayout


def lower_precision_modules() -> list[str]:
    """DeepSpeed's `lower_precision_safe_modules` under torch_autocast: every matmul module, and the holder of their
    flat tensors under --zero3-fetch flat (`gpt2.runtime.flat_blocks`)."""
    from gpt2.runtime.flat_blocks import MATMUL_TYPES, MatmulFlatParams

    return [f"{cls.__module__}.{cls.__qualname__}" for cls in (*MATMUL_TYPES, MatmulFlatParams)]


def build_ds_config(layout: RunLayout) -> dict[str, Any]:
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
        ds["torch_autocast"].setdefault("lower_precision_safe_modules", lower_precision_modules())
    ds["zero_allow_untested_optimizer"] = True  # torch AdamW: DeepSpeed only "tests" its own optimizers
    return ds
