"""FSDP2's units (gpt2.engines.fsdp2_engine.shard_model): --fsdp2-unit-blocks consecutive blocks are one module (a
BlockUnit, grouped by gpt2.runtime.parallelize) and one `fully_shard` unit (one all-gather, one reduce-scatter, one
set of hooks), under --compile one compiled graph, in a one-rank gloo group in this process."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from gpt2.config.cli import parse_args
from gpt2.config.layout import RunLayout
from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.engines.fsdp2_engine import renamed, shard_model
from gpt2.model.gpt import GPT
from gpt2.runtime.block_units import BlockUnit, block_key, group_blocks
from gpt2.runtime.flat_blocks import FlatBlock, unflatten_state_dict
from gpt2.runtime.parallelize import parallelize
from parallel.dims import ParallelDims

# FSDP2 over its own tensors: the units' modules and names (the flat tensors' test is below)
FSDP2_ARGS = ["--mode", "hybrid", "--zero-engine", "fsdp2", "--model", "gpt2-tiny", "--fsdp2-params", "tensors"]


def test_blocks_are_sharded_in_groups_of_the_unit_size(gloo_world) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**MODEL_PRESETS["gpt2-tiny"], "n_layer": 5}))
    blocks = list(model.blocks)
    group_blocks(model, 2)
    units = shard_model(model, init_device_mesh("cpu", (1,)), reshard_after_forward=True)
    assert units == [*model.blocks, model]  # units [0, 1], [2, 3], [4], then the root
    assert [list(unit.layers) for unit in units[:-1]] == [blocks[0:2], blocks[2:4], blocks[4:]]
    assert all(isinstance(unit, BlockUnit) and isinstance(unit, FSDPModule) for unit in units[:-1])
    per_block = len(list(blocks[4].parameters()))
    assert [len(unit._get_fsdp_state()._fsdp_param_group.fsdp_params) for unit in units[:-1]] == [
        2 * per_block, 2 * per_block, per_block]
    x = torch.randint(0, 50257, (2, 16))
    loss, _ = model(x, x)
    loss.backward()  # the units gather for forward and backward and reshard after
    assert all(isinstance(p, torch.distributed.tensor.DTensor) and p.grad is not None for p in model.parameters())


def count_graphs(monkeypatch: pytest.MonkeyPatch, backend: str = "eager") -> list[torch.fx.GraphModule]:
    """Every graph the harness's torch.compile calls capture from now on, compiled by `backend` (no Inductor: the
    count, not the kernels, is what is checked)."""
    import torch._dynamo

    graphs: list[torch.fx.GraphModule] = []
    real_compile = torch.compile
    compile_backend = torch._dynamo.lookup_backend(backend)

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return compile_backend(gm, example_inputs)

    torch._dynamo.reset()  # no graph cached from an earlier test
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, backend=record))
    return graphs


def fsdp2_model(args: list[str]) -> tuple[GPT, list[torch.nn.Module]]:
    """The FSDP2 engine's model build on one rank: parallelize (TP plan, checkpointing, units, compile) -> shard."""
    layout = RunLayout.resolve(parse_args(FSDP2_ARGS + args), world_size=1, device="cpu")
    torch.manual_seed(0)
    model = parallelize(GPT(layout.cfg.model), layout, ParallelDims(world_size=1, rank=0))
    return model, shard_model(model, init_device_mesh("cpu", (1,)), reshard_after_forward=True)


def loss_and_grads(model: GPT) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    x = torch.randint(0, 50257, (2, 16))
    loss, _ = model(x, x)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if isinstance(model.blocks[0], FlatBlock):  # --fsdp2-params flat: the members' gradients, by their names
        grads = unflatten_state_dict(grads, model.blocks[0].layout())
    return loss.item(), {block_key(n, 2): grad for n, grad in grads.items()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_unit_is_one_module_and_one_compiled_graph(gloo_world, monkeypatch: pytest.MonkeyPatch,
                                                        checkpointing: bool) -> None:
    """Under --compile each FSDP2 unit (gpt2-tiny's 2 blocks at the default --fsdp2-unit-blocks) is one BlockUnit
    whose forward is one graph, FSDP2's hooks outside it: a forward captures one graph a unit (+ the final
    LayerNorm's and the LM head's), not one a block; --activation-checkpointing recomputes each block inside the
    unit's graph (aot_eager: AOTAutograd's partitioner handles the checkpoints, as under Inductor) and trains the
    eager function."""
    ac = ["--activation-checkpointing"] if checkpointing else []
    eager_loss, eager_grads = loss_and_grads(fsdp2_model(ac)[0])
    graphs = count_graphs(monkeypatch, "aot_eager")
    with torch._dynamo.config.patch(recompile_limit=8):
        model, units = fsdp2_model(["--compile", *ac])
        *block_units, root = units
        assert len(block_units) == 1 and block_units == list(model.blocks) and root is model
        assert all(isinstance(u, BlockUnit) and isinstance(u, FSDPModule) and len(u.layers) == 2 for u in block_units)
        assert all(u.checkpoint_layers is checkpointing for u in block_units) and not model.activation_checkpointing
        loss, grads = loss_and_grads(model)
    assert len(graphs) == len(block_units) + 2  # each unit, ln_f, the LM head + loss: one graph each
    assert abs(loss - eager_loss) < 1e-5
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def recorded_checkpoints(monkeypatch: pytest.MonkeyPatch) -> list[torch.nn.Module]:
    """The modules `torch.utils.checkpoint` is called on from here on, by a unit (its blocks) or by GPT.forward."""
    calls: list[torch.nn.Module] = []
    real = torch.utils.checkpoint.checkpoint

    def recorded(fn: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
        calls.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr("gpt2.runtime.block_units.checkpoint", recorded)
    monkeypatch.setattr("gpt2.model.gpt.checkpoint", recorded)
    return calls


def test_checkpointing_recomputes_each_block_inside_its_unit(gloo_world, monkeypatch: pytest.MonkeyPatch) -> None:
    """--activation-checkpointing under FSDP2 units: each block checkpointed on its own (backward recomputes one block
    at a time, as before units were modules), not the whole unit."""
    calls = recorded_checkpoints(monkeypatch)
    model, _ = fsdp2_model(["--activation-checkpointing"])
    loss_and_grads(model)
    assert calls == list(model.blocks[0].layers)


def test_flat_units_are_checkpointed_whole_and_train_the_eager_function(gloo_world,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--activation-checkpointing over flat unit tensors (--fsdp2-params flat): GPT.forward checkpoints each unit
    whole (a block's recompute inside the unit would run outside its views of the flat tensors, on parameters that
    are not there), and loss and gradients are the tensors layout's without checkpointing."""
    reference, reference_grads = loss_and_grads(fsdp2_model([])[0])
    calls = recorded_checkpoints(monkeypatch)
    model, _ = fsdp2_model(["--fsdp2-params", "flat", "--activation-checkpointing"])
    assert isinstance(model.blocks[0], FlatBlock) and model.activation_checkpointing
    loss, grads = loss_and_grads(model)
    assert calls == [model.blocks[0]] and abs(loss - reference) < 1e-5
    assert grads.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpoint_names_are_the_blocks_own() -> None:
    """The engine's checkpoint state renames the units' parameters to the blocks' names and back (a checkpoint does
    not depend on --fsdp2-unit-blocks), in the model's and in the optimizer's keys."""
    state = {"model": {"blocks.1.layers.1.attn.c_attn.weight": 1, "wte.weight": 2},
             "optimizer": {"state": {"blocks.1.layers.1.attn.c_attn.weight": {"step": 3}},
                           "param_groups": [{"lr": 0.1, "params": ["blocks.0.layers.0.ln_1.weight", "wte.weight"]}]}}
    plain = renamed(state, lambda key: block_key(key, 2))
    assert plain == {"model": {"blocks.3.attn.c_attn.weight": 1, "wte.weight": 2},
                     "optimizer": {"state": {"blocks.3.attn.c_attn.weight": {"step": 3}},
                                   "param_groups": [{"lr": 0.1, "params": ["blocks.0.ln_1.weight", "wte.weight"]}]}}
    back = {"blocks.3.attn.c_attn.weight": "blocks.1.layers.1.attn.c_attn.weight",
            "blocks.0.ln_1.weight": "blocks.0.layers.0.ln_1.weight"}
    assert renamed(plain, lambda key: back.get(key, key)) == state


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_forward_prefetch_issues_the_next_units_gathers_before_a_unit_runs(gloo_world, depth: int) -> None:
    """When block i starts (FSDP2's hook has gathered its unit and resharded the ones before), the block units with
    an all-gather issued or done are i and the `depth` after it (FSDP2's own hook issues only its unit's)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**MODEL_PRESETS["gpt2-tiny"], "n_layer": 4}))
    units = shard_model(model, init_device_mesh("cpu", (1,)), reshard_after_forward=True, forward_prefetch=depth)
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
