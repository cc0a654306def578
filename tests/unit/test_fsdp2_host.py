"""The FSDP2 engine's host work a step (gpt2.engines.fsdp2_engine.FSDP2Engine): what it does per parameter and
per module, counted (never timed), on an engine built as train.py builds it, in a one-rank gloo group in this
process."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._api import _ToTorchTensor

from gpt2.config.cli import parse_args
from gpt2.engines.build import build_engine
from gpt2.engines.fsdp2_engine import FSDP2Engine
from gpt2.engines.guard import step_if_finite
from gpt2.runtime.distributed import init_distributed

FSDP2_ARGS = ["--mode", "hybrid", "--zero-engine", "fsdp2", "--model", "gpt2-tiny", "--n-layer", "4",
              "--fsdp2-unit-blocks", "2", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]


@pytest.fixture
def engine(gloo_launch) -> FSDP2Engine:
    """The FSDP2 engine of a launch of one rank (the group exists: init_distributed uses it), after one step."""
    torch.manual_seed(0)
    engine = build_engine(*init_distributed(parse_args(FSDP2_ARGS)))
    assert isinstance(engine, FSDP2Engine)
    step(engine)
    return engine


def step(engine: FSDP2Engine) -> None:
    backward(engine)
    engine.optimizer_step()


def backward(engine: FSDP2Engine) -> list[torch.nn.Parameter]:
    x = torch.randint(0, 50257, (2, 16))
    engine.forward_backward(x, x, last_micro_step=True)
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def test_grad_norm_makes_no_autograd_call_per_gradient(engine: FSDP2Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """DTensor.to_local with grad enabled is an autograd Function (`_ToTorchTensor`) call per gradient, and a call
    through DTensor's dispatch without; the norm needs neither. It is the one torch computes over the full
    gradients."""
    params = backward(engine)
    calls = []
    forward, to_local = _ToTorchTensor.forward, DTensor.to_local
    monkeypatch.setattr(_ToTorchTensor, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))
    monkeypatch.setattr(DTensor, "to_local", lambda self, **kw: calls.append(2) or to_local(self, **kw))
    norm = engine.grad_norm(params)
    assert calls == []
    full = torch.nn.utils.get_total_norm([p.grad.full_tensor() for p in params])
    torch.testing.assert_close(norm, full, rtol=1e-6, atol=0)


def test_optimizer_step_makes_no_call_per_tensor_for_its_local_shards(engine: FSDP2Engine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """LocalShardAdamW hands its kernel each DTensor's local tensor without a call per tensor (DTensor.to_local:
    four a parameter, its gradient and moments); the update lands in the DTensors (the same storage)."""
    params = backward(engine)
    calls = []
    to_local = DTensor.to_local
    monkeypatch.setattr(DTensor, "to_local", lambda self, **kw: calls.append(1) or to_local(self, **kw))
    before = [p._local_tensor.clone() for p in params]
    step_if_finite(engine.optimizer, torch.tensor(1.0))
    assert calls == []
    assert all(not torch.equal(p._local_tensor, b) for p, b in zip(params, before))


def test_gradient_sync_is_set_on_each_unit_when_it_changes(engine: FSDP2Engine,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """no_sync sets FSDP2's gradient sync as the root's recursive call would (every unit's, the root's included),
    without walking the model's submodules, and not at all while it stays (every micro-step at --grad-accum 1)."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in engine.module.modules() if isinstance(m, FSDPModule)]
    assert len(groups) == len(engine.units) == 3  # two units of two blocks, the root
    walks, sets = [], []
    modules, set_sync = torch.nn.Module.modules, FSDPModule.set_requires_gradient_sync
    monkeypatch.setattr(torch.nn.Module, "modules", lambda self: walks.append(self) or modules(self))
    monkeypatch.setattr(FSDPModule, "set_requires_gradient_sync",
                        lambda self, sync, **kw: sets.append(self) or set_sync(self, sync, **kw))
    for last_micro_step in (True, False, False, True, True):  # a step, one accumulating over 3 micro-steps, a step
        engine.no_sync(last_micro_step)
        assert all(g.reduce_grads == g.all_reduce_grads == last_micro_step for g in groups)
    assert walks == [] and sets == 2 * engine.units
