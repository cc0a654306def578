"""FSDP2's units (gpt2.engines.fsdp2_engine.shard_model): --fsdp2-unit-blocks consecutive blocks share one
`fully_shard` group (one all-gather, one reduce-scatter, one set of hooks), in a one-rank gloo group in this process."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_forward_prefetch_issues_the_next_units_gathers_before_a_unit_runs(gloo_world, depth: int) -> None:
    """When block i starts (FSDP2's hook has gathered its unit and resharded the ones before), the block units with
    an all-gather issued or done are i and the `depth` after it (FSDP2's own hook issues only its unit's)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**MODEL_PRESETS["gpt2-tiny"], "n_layer": 4}))
    units = shard_model(model, init_device_mesh("cpu", (1,)), reshard_after_forward=True, unit_blocks=1,
                        forward_prefetch=depth)
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units[:-1]]
    issued_at_start: list[list[int]] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: issued_at_start.append(
            [i for i, g in enumerate(groups) if g.is_unsharded or g._all_gather_result is not None]))
    x = torch.randint(0, 50257, (2, 16))
    loss, _ = model(x, x)
    assert issued_at_start == [list(range(i, min(i + 1 + depth, 4))) for i in range(4)]
    loss.backward()  # backward gathers the resharded units again, prefetched or not
    assert all(p.grad is not None for p in model.parameters())
