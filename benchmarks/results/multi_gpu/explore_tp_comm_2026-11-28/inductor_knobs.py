"""Run train.py under one of Inductor's settings for the TP collectives of the compiled graphs (exploration record).

    KNOB=overlap torchrun --nproc_per_node=2 inductor_knobs.py train.py --mode hybrid --zero-engine fsdp2 \
        --tp-size 2 --compile ...

KNOB: none | overlap (the FX overlap scheduler, `aten_distributed_optimizations.enable_overlap_scheduling`) |
asynctp (micro-pipeline TP, `_micro_pipeline_tp`, with symmetric memory on the TP group; it matches only the
functional sequence collectives of `functional_sequence_collectives.patch`) | inplace (load the committed
`parallel/comm.py` from COMM_FILE instead of the patched one, to compare both in one checkout).
"""

import importlib.util
import os
import runpy
import sys

import torch._inductor.config as inductor_config

sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))  # the repository root, for train.py's imports
knob = os.environ.get("KNOB", "none")
if knob == "inplace":
    spec = importlib.util.spec_from_file_location("parallel.comm", os.environ["COMM_FILE"])
    module = importlib.util.module_from_spec(spec)
    sys.modules["parallel.comm"] = module
    spec.loader.exec_module(module)
if knob == "overlap":
    inductor_config.aten_distributed_optimizations.enable_overlap_scheduling = True
if knob == "asynctp":
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    from parallel.dims import ParallelDims

    build_groups = ParallelDims.build_groups

    def build_groups_with_symmetric_memory(self: ParallelDims) -> None:
        build_groups(self)
        if self.tp_size > 1:
            enable_symm_mem_for_group(self.tp_group.group_name)  # the pass fuses only where the group has it

    ParallelDims.build_groups = build_groups_with_symmetric_memory
print(f"[inductor_knobs] {knob}", flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
