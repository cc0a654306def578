"""FSDP2's bf16 gather of the blocks (--fsdp2-gather bf16, gpt2.engines.fsdp2_engine.shard_model): under torch.autocast
it trains single's function but for the blocks' LayerNorm scales and biases, which it rounds to bf16, and their
gradients, which come out in bf16. With LayerNorm values bf16 holds exactly, the loss and every other gradient equal
the unsharded autocast model's to the bit (the matmuls see the values autocast casts to; the residual stream stays
fp32) and the block LayerNorms' gradients are the reference's rounded to bf16; with any LayerNorm values, everything
differs by about that rounding only. CPU autocast (bf16), a one-rank gloo group in this process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.engines.fsdp2_engine import shard_model
from gpt2.model.gpt import GPT, LayerNorm


def model_with_layernorms(exact_in_bf16: bool) -> GPT:
    """gpt2-tiny (2 blocks) whose LayerNorm scales and biases are random: bf16-representable or not."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**MODEL_PRESETS["gpt2-tiny"], "n_layer": 2}))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LayerNorm):
                for p in (m.weight, m.bias):
                    p.copy_(1 + 0.1 * torch.randn_like(p) if p is m.weight else 0.1 * torch.randn_like(p))
                    if exact_in_bf16:
                        p.copy_(p.bfloat16().float())
    return model


def loss_and_grads(model: GPT) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    x = torch.randint(0, 50257, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, x)[0]
    loss.backward()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in model.named_parameters()}
    return loss.detach(), grads


def is_layernorm(name: str) -> bool:
    return ".ln_" in name or name.startswith("ln_f")


@pytest.mark.parametrize("exact_in_bf16", [True, False])
def test_bf16_gather_is_autocast_but_for_layernorm_rounding(gloo_world, exact_in_bf16: bool) -> None:
    reference = model_with_layernorms(exact_in_bf16)
    sharded = copy.deepcopy(reference)
    gathered: dict[str, torch.dtype] = {}

    def record(module: torch.nn.Module, args: tuple, name: str) -> None:  # the weight's dtype in its forward
        gathered[name] = module.weight.dtype

    for name, m in sharded.named_modules():
        if hasattr(m, "weight") and name:
            m.register_forward_pre_hook(lambda mod, args, name=name: record(mod, args, name))
    shard_model(sharded, init_device_mesh("cpu", (1,)), reshard_after_forward=True,
                block_gather_dtype=torch.bfloat16)
    ref_loss, ref_grads = loss_and_grads(reference)
    loss, grads = loss_and_grads(sharded)

    assert {n: d for n, d in gathered.items() if n.startswith("blocks.")} and all(
        d == (torch.bfloat16 if n.startswith("blocks.") else torch.float32) for n, d in gathered.items())
    assert all(g.dtype == torch.float32 for g in grads.values())  # reduced and kept in fp32
    if exact_in_bf16:
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    else:  # LayerNorm's affine parameters rounded to bf16: a small change, not none
        assert loss != ref_loss
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
    for name, g in grads.items():
        if not exact_in_bf16:  # LayerNorm's rounding moves every gradient a little
            drift = ((g - ref_grads[name]).norm() / ref_grads[name].norm()).item()
            assert drift < 1e-2, (name, drift)
        elif is_layernorm(name) and name.startswith("blocks."):  # in its bf16 parameter's dtype: the reference's,
            # rounded to bf16 (ln_f's stays fp32: the root gathers fp32)
            torch.testing.assert_close(g, ref_grads[name].bfloat16().float(), rtol=0, atol=0, msg=name)
        else:
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=0, msg=name)
