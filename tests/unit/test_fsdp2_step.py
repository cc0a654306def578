"""FSDP2's optimizer step (gpt2.engines.fsdp2_engine.LocalShardAdamW): torch's fused AdamW run on each DTensor's
local shard updates parameters and moments exactly as AdamW over the DTensors does, skips a non-finite step the
same way, and dispatches no op on a DTensor; in a one-rank gloo group in this process."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.engines.fsdp2_engine import LocalShardAdamW, shard_model
from gpt2.engines.guard import step_if_finite
from gpt2.model.gpt import GPT
from gpt2.runtime.parallelize import param_groups


class DTensorOps(TorchDispatchMode):
    """Records the ops dispatched with a DTensor among their arguments (a mode sees them before DTensor does)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs or {}))):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def sharded_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**MODEL_PRESETS["gpt2-tiny"], "n_layer": 2}))
    shard_model(model, init_device_mesh("cpu", (1,)), reshard_after_forward=True)
    return model


def adamw(cls: type[torch.optim.AdamW], model: GPT) -> torch.optim.AdamW:
    return cls(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), fused=True)


def test_local_shard_step_is_adamw_on_the_dtensors(gloo_world) -> None:
    ref, local = sharded_model(), sharded_model()
    ref_opt, local_opt = adamw(torch.optim.AdamW, ref), adamw(LocalShardAdamW, local)
    for step in range(4):
        torch.manual_seed(step)
        x = torch.randint(0, 50257, (2, 16))
        for model, opt in ((ref, ref_opt), (local, local_opt)):
            model(x, x)[0].backward()
            # step 2: a non-finite norm; the fused kernel skips the update on the device
            step_if_finite(opt, torch.tensor(float("nan") if step == 2 else 1.0))
            opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(ref.named_parameters(), local.parameters()):
        assert isinstance(q, DTensor), name
        torch.testing.assert_close(q.to_local(), p.to_local(), rtol=0, atol=0, msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = ref_opt.state[p][key], local_opt.state[q][key]
            assert isinstance(b, DTensor) == isinstance(a, DTensor), (name, key)  # the state stays DTensor
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"{name} {key}")
    assert ref_opt.state[next(ref.parameters())]["step"].item() == 3  # the NaN step was skipped


@pytest.mark.parametrize("cls", [LocalShardAdamW, torch.optim.AdamW])
def test_local_shard_step_dispatches_no_dtensor_op(gloo_world, cls: type[torch.optim.AdamW]) -> None:
    """AdamW on the DTensors dispatches its ops through DTensor (the check can see them); the local step none."""
    model = sharded_model()
    opt = adamw(cls, model)
    x = torch.randint(0, 50257, (2, 16))
    model(x, x)[0].backward()
    opt.step()  # the first step creates the moments: DTensors, as the parameters (zeros_like)
    model(x, x)[0].backward()
    before = [p.to_local().detach().clone() for p in model.parameters()]
    with DTensorOps() as seen:
        opt.step()
    assert bool(seen.ops) == (cls is torch.optim.AdamW)
    assert all(not torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))  # every shard moved
