"""FSDP2's units (gpt2.engines.fsdp2_engine.shard_model): --fsdp2-unit-blocks consecutive blocks share one
`fully_shard` group (one all-gather, one reduce-scatter, one set of hooks), in a one-rank gloo group in this process."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.engines.fsdp2_engine import shard_model
from gpt2.model.gpt import GPT


def test_blocks_are_sharded_in_groups_of_the_unit_size(gloo_world) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**MODEL_PRESETS["gpt2-tiny"], "n_layer": 5}))
    units = shard_model(model, init_device_mesh("cpu", (1,)), reshard_after_forward=True, unit_blocks=2)
    b = model.blocks
    assert units == [b[0], b[2], b[4], model]  # groups [0, 1], [2, 3], [4], then the root

    def group(block: torch.nn.Module):
        return block._get_fsdp_state()._fsdp_param_group

    assert group(b[0]) is group(b[1]) and group(b[2]) is group(b[3]) and group(b[1]) is not group(b[2])
    per_block = len(list(b[4].parameters()))
    assert [len(group(block).fsdp_params) for block in (b[0], b[2], b[4])] == [2 * per_block, 2 * per_block,
                                                                                   per_block]
    x = torch.randint(0, 50257, (2, 16))
    loss, _ = model(x, x)
    loss.backward()  # the groups gather for forward and backward and reshard after
    assert all(isinstance(p, torch.distributed.tensor.DTensor) and p.grad is not None for p in model.parameters())
