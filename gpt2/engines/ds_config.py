"""The DeepSpeed config of a `--mode hybrid` run: the file `RunLayout.resolve` read and checked
(`gpt2.config.deepspeed_file`: ds_configs/zero{stage}.json or --ds-config) + our CLI values. Only builds: every
check on the file is the layout's, made before any work.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from gpt2.config.deepspeed_file import harness_values, persistence_threshold_default, precision_values

if TYPE_CHECKING:
    from gpt2.config.layout import RunLayout


def lower_precision_modules() -> list[str]:
    """The modules whose weights ZeRO gathers and reduces in the autocast dtype under torch_autocast: every matmul
    weight (autocast would cast it to 16 bits anyway), not the embeddings or LayerNorms, which compute in fp32."""
    from gpt2.model.gpt import Linear
    from parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [f"{cls.__module__}.{cls.__qualname__}" for cls in (Linear, ColumnParallelLinear, RowParallelLinear)]


def build_ds_config(layout: RunLayout) -> dict[str, Any]:
    """The DeepSpeed config: the run's file + our CLI values (which the layout checked it agrees with), ZeRO-3's
    defaults where the file leaves them out, and the precision that runs (CPU runs are fp32 whatever --precision
    says)."""
    assert layout.ds_file is not None, "a hybrid run's layout carries its DeepSpeed file"
    cfg = layout.cfg
    ds = copy.deepcopy(dict(layout.ds_file))
    for keys, ours, _ in harness_values(cfg, layout.grad_accum, layout.dp_size, layout.deepcompile):
        node = ds
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = ours
    if layout.zero_stage == 3:
        zero = ds["zero_optimization"]
        # DeepCompile (--zero3-fetch stays at its default, block): 0 as well, every parameter partitioned by zero.Init;
        # DeepCompile then marks every parameter non-persistent anyway (deepspeed/compile/init_z3.py, `ds_persist`)
        zero.setdefault("stage3_param_persistence_threshold", persistence_threshold_default(cfg.parallel.zero3_fetch))
        # DeepSpeed's default (true) makes zero.Init replace torch.nn.functional.linear process-wide by its
        # autograd.Function LinearFunctionForZeroStage3. Traced by Dynamo (torch 2.11, CUDA, any backend) it returns
        # zero weight and bias gradients (benchmarks/repro/deepspeed_zero3_linear_compile.py): under --compile the
        # blocks' and the head's Linears stopped learning (GPT-2, 4 layers: 8.28 after 15 steps where single reaches
        # 6.08). With false the model calls torch's linear like every other mode, and eager and compiled ZeRO-3
        # match single within 0.01; the saving it offers is moot here, a block's weights are re-gathered before
        # its backward either way. A file that turns it on under --compile is refused by the layout.
        zero.setdefault("memory_efficient_linear", False)
    # the precision that runs (the layout's: CPU runs are fp32 whatever --precision says)
    for (section, key), value in precision_values(layout.precision, cfg.parallel.zero_precision).items():
        ds.setdefault(section, {})[key] = value
    if ds["torch_autocast"]["enabled"]:
        ds["torch_autocast"].setdefault("lower_precision_safe_modules", lower_precision_modules())
    ds["zero_allow_untested_optimizer"] = True  # torch AdamW: DeepSpeed only "tests" its own optimizers
    return ds
