"""DeepSpeed's `mpu` protocol over a ParallelDims, so ZeRO partitions over the DP group only.

`deepspeed.initialize(model=..., mpu=ModelParallelUnit(dims))` makes ZeRO shard parameters, gradients
and optimizer states across `dims.dp_group` (each TP rank's shard of a weight is a different tensor,
partitioned among its own data-parallel peers) and lets gradient-norm clipping sum over the TP group.
DeepSpeed reads both the old Megatron names (model_parallel) and the new ones (tensor_model_parallel);
there is no pipeline parallelism here, so the pipeline stage is always 0 of 1.
"""

from __future__ import annotations

import torch.distributed as dist

from parallel.dims import ParallelDims


class ModelParallelUnit:
    def __init__(self, dims: ParallelDims):
        if dims.tp_group is None or dims.dp_group is None:
            raise ValueError("ParallelDims has no process groups yet; call dims.build_groups() on every rank first")
        self.dims = dims

    # tensor (model) parallel
    def get_tensor_model_parallel_rank(self) -> int:
        return self.dims.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.dims.tp_size

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.dims.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of this TP group's first member (broadcast source for inputs shared by the group)."""
        return self.dims.dp_rank * self.dims.tp_size

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    # data parallel
    def get_data_parallel_rank(self) -> int:
        return self.dims.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dims.dp_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dims.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dims.grid()[:, self.dims.tp_rank].tolist()

    # no pipeline parallelism
    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1
