"""`--zero3-fetch flat` (gpt2.runtime.flat_blocks), in one process without DeepSpeed: a FlatBlock computes its
Block's function and hands each member its own gradient, its flat tensors are grouped as ZeRO must treat them (the
Linear types, weight decay, the TP plan's marks), and the layout restores every parameter name for export.
End to end under DeepSpeed ZeRO-3 (2 ranks, with and without TP): tests/integration/test_zero.py."""

from __future__ import annotations

import copy

import pytest
import torch

from gpt2.config.deepspeed_file import LOWER_PRECISION_MODULES
from gpt2.config.schema import ModelConfig
from gpt2.model.gpt import GPT
from gpt2.runtime.block_units import group_blocks, ungroup_state_dict
from gpt2.runtime.flat_blocks import MATMUL_TYPES, FlatBlock, MatmulFlatParams, flatten_blocks, unflatten_state_dict
from gpt2.runtime.parallelize import param_groups

CFG = ModelConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=8)


def models(unit_blocks: int = 1) -> tuple[GPT, GPT]:
    """(per-tensor, flat): the same seed's weights; the flat one's blocks in units of `unit_blocks`
    (--zero3-unit-blocks, gpt2.runtime.block_units), each unit flattened as one."""
    torch.manual_seed(0)
    plain = GPT(CFG)
    flat = copy.deepcopy(plain)
    if unit_blocks > 1:
        group_blocks(flat, unit_blocks)
    flatten_blocks(flat)
    return plain, flat


def member_grads(flat: GPT, unit_blocks: int) -> dict[str, torch.Tensor]:
    """The flat model's gradients under the per-tensor model's names."""
    grads = unflatten_state_dict({n: p.grad for n, p in flat.named_parameters()}, flat.blocks[0].layout())
    return ungroup_state_dict(grads, unit_blocks)


@pytest.mark.parametrize("unit_blocks", [1, 2])
def test_flat_blocks_train_the_same_function(unit_blocks: int) -> None:
    plain, flat = models(unit_blocks)
    idx = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))  # [B, T]
    for model in (plain, flat):
        loss, _ = model(idx, idx)
        loss.backward()
    assert torch.equal(plain(idx), flat(idx))
    flat_grads = member_grads(flat, unit_blocks)
    plain_grads = {n: p.grad for n, p in plain.named_parameters()}
    assert flat_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.equal(flat_grads[name], grad), name


@pytest.mark.parametrize("unit_blocks", [1, 2])
def test_compiled_flat_blocks_train_the_same_function(unit_blocks: int) -> None:
    """--compile compiles each FlatBlock's forward (views + functional_call; with units, of 2 blocks in one graph)
    as ZeRO-3 does (compile_forwards): the torch floor (scripts/test_torch_floor.sh, 2.11, the GPU machines' torch)
    runs this too."""
    from gpt2.runtime.compiling import compile_forwards

    plain, flat = models(unit_blocks)
    compile_forwards(flat)
    idx = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))  # [B, T]
    losses = []
    for model in (plain, flat):
        loss, _ = model(idx, idx)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5
    flat_grads = member_grads(flat, unit_blocks)
    for name, param in plain.named_parameters():
        assert torch.allclose(flat_grads[name], param.grad, atol=1e-5, rtol=1e-4), name


def test_flat_groups_are_what_zero_treats_alike() -> None:
    plain, flat = models()
    block = flat.blocks[0]
    assert dict(block.named_parameters()).keys() == {"matmul.decay", "matmul.no_decay", "other.no_decay"}
    assert not list(block.block.parameters())  # the Block keeps none: DeepSpeed sees the flat tensors only
    members = {path: [name for name, _ in named] for path, named in block.layout().items()}
    assert members["matmul.decay"] == ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                                       "mlp.c_proj.weight"]
    assert members["other.no_decay"] == ["ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"]
    # the Linear holder is in DeepSpeed's lower-precision list (gathered in bf16 under autocast), the other not
    assert isinstance(block.matmul, MatmulFlatParams) and not isinstance(block.other, MatmulFlatParams)
    names = tuple(f"{cls.__module__}.{cls.__qualname__}" for cls in (*MATMUL_TYPES, MatmulFlatParams))
    assert names == LOWER_PRECISION_MODULES
    # AdamW: the same numbers of decayed and undecayed values as the per-tensor model
    for ours, theirs in zip(param_groups(flat, 0.1), param_groups(plain, 0.1)):
        assert sum(p.numel() for p in ours["params"]) == sum(p.numel() for p in theirs["params"])
        assert ours["weight_decay"] == theirs["weight_decay"]


def test_the_tp_plans_marks_split_the_groups_and_travel() -> None:
    """Under TP, column-parallel biases are sharded (tensor_model_parallel) and row-parallel ones replicated (and
    sequence_parallel under SP): they must not share a flat tensor, and each flat tensor carries its members' marks."""
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:  # the marks apply_tensor_parallel sets with --sequence-parallel
        for linear in (block.attn.c_attn, block.mlp.c_fc):
            linear.weight.tensor_model_parallel = linear.bias.tensor_model_parallel = True
        for linear in (block.attn.c_proj, block.mlp.c_proj):
            linear.weight.tensor_model_parallel = linear.bias.sequence_parallel = True
        for ln in (block.ln_1, block.ln_2):
            ln.weight.sequence_parallel = ln.bias.sequence_parallel = True
    flatten_blocks(model)
    block = model.blocks[0]
    layout = block.layout()
    assert [name for name, _ in layout["matmul.no_decay_tp"]] == ["attn.c_attn.bias", "mlp.c_fc.bias"]
    assert [name for name, _ in layout["matmul.no_decay_sp"]] == ["attn.c_proj.bias", "mlp.c_proj.bias"]
    assert set(layout) == {"matmul.decay_tp", "matmul.no_decay_tp", "matmul.no_decay_sp", "other.no_decay_sp"}
    for path in layout:
        p = block.get_parameter(path)
        assert getattr(p, "tensor_model_parallel", False) == path.endswith("_tp"), path
        assert getattr(p, "sequence_parallel", False) == path.endswith("_sp"), path


def test_unflatten_restores_every_name_and_value() -> None:
    plain, flat = models()
    restored = unflatten_state_dict(flat.state_dict(), flat.blocks[0].layout())
    expected = plain.state_dict()
    assert restored.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(restored[name], value), name


@pytest.mark.parametrize("flat_run", [True, False])
def test_a_checkpoint_of_the_other_layout_is_refused(flat_run: bool) -> None:
    from pathlib import Path

    from gpt2.config.cli import parse_args
    from gpt2.config.layout import RunLayout
    from gpt2.train.checkpoint import CheckpointError, build_meta, check_compatible

    def layout(fetch: str) -> RunLayout:
        args = ["--mode", "hybrid", "--model", "gpt2-tiny", "--device", "cpu", "--zero3-fetch", fetch]
        return RunLayout.resolve(parse_args(args), 2, "cpu")

    run, saved = (layout("flat"), layout("block")) if flat_run else (layout("block"), layout("flat"))
    meta = build_meta(saved, step=5)
    check_compatible(meta, saved, Path("ck"))  # its own layout resumes
    with pytest.raises(CheckpointError, match=f"zero3_flat: checkpoint .*--zero3-fetch flat.*resume it with "
                                              f"--zero3-fetch {'block' if flat_run else 'flat'}"):
        check_compatible(meta, run, Path("ck"))


def test_a_checkpoint_from_before_the_flat_default_names_its_flags() -> None:
    """A ZeRO-3 checkpoint saved before flat units of 4 became the default (its meta has neither key: per-block
    gather, one block a leaf) is refused under the default layout, naming the flags that resume it."""
    from pathlib import Path

    from gpt2.config.cli import parse_args
    from gpt2.config.layout import RunLayout
    from gpt2.train.checkpoint import CheckpointError, build_meta, check_compatible

    default = RunLayout.resolve(parse_args(["--mode", "hybrid", "--model", "gpt2", "--device", "cpu"]), 2, "cpu")
    assert (default.zero3_flat, default.zero3_unit_blocks) == (True, 4)
    old = {k: v for k, v in build_meta(default, step=5).items()
           if k not in ("zero3_fetch", "zero3_flat", "zero3_unit_blocks")}
    with pytest.raises(CheckpointError, match=r"resume it with --zero3-fetch block\).*resume it with "
                                              r"--zero3-unit-blocks 1\)"):
        check_compatible(old, default, Path("ck"))
    pinned = parse_args(["--mode", "hybrid", "--model", "gpt2", "--device", "cpu", "--zero3-fetch", "block",
                         "--zero3-unit-blocks", "1"])
    check_compatible(old, RunLayout.resolve(pinned, 2, "cpu"), Path("ck"))  # with them it resumes
    # a DeepSpeed run without ZeRO-3's gather hooks (DeepCompile) refuses both flags: the refusal names no such fix
    deepcompile = RunLayout.resolve(parse_args(["--mode", "hybrid", "--model", "gpt2", "--compile", "--compiler",
                                                "deepcompile"]), 2, "cuda")  # resolves anywhere; runs on CUDA only
    assert deepcompile.zero3_fetch is None
    with pytest.raises(CheckpointError, match="zero3_flat: checkpoint True") as refused:
        check_compatible(build_meta(default, step=5), deepcompile, Path("ck"))
    assert "resume it with --zero3" not in str(refused.value), refused.value
    # under another engine (FSDP2) the engine is the difference: an old checkpoint (no zero_engine key) counts as
    # DeepSpeed's, and DeepSpeed's fetch flags are no advice (tests/integration/test_checkpoint.py)
    fsdp2 = RunLayout.resolve(parse_args(["--mode", "hybrid", "--model", "gpt2", "--device", "cpu", "--zero-engine",
                                          "fsdp2"]), 2, "cpu")
    for meta in (old, build_meta(default, step=5)):
        with pytest.raises(CheckpointError, match="zero_engine: checkpoint 'deepspeed', this run 'fsdp2'") as refused:
            check_compatible(meta, fsdp2, Path("ck"))
        assert "zero3" not in str(refused.value), refused.value


@pytest.mark.parametrize("unit_blocks", [1, 2])
def test_module_walks_skip_the_inner_block_and_train_still_reaches_it(unit_blocks: int) -> None:
    """The inner block is not a submodule, so DeepSpeed's walks of a leaf module (and of the model) visit only the
    flat tensors' holders; train()/eval() must still reach its dropouts and attention, and a block that holds a
    buffer (which .to() and state_dict would lose) is refused."""
    _, flat = models(unit_blocks)
    unit = flat.blocks[0]
    assert [name for name, _ in unit.named_modules()] == ["", "matmul", "other"]
    assert sorted(name for name, _ in unit.named_parameters()) == sorted(unit.members)
    for mode in (False, True):
        flat.train(mode)
        assert all(m.training is mode for m in unit.block.modules())
    block = copy.deepcopy(models()[0].blocks[0])
    block.register_buffer("extra", torch.zeros(1))
    with pytest.raises(ValueError, match="holds buffers"):
        FlatBlock(block)
