"""Engine details that need no process group: the fp16 loss-scaler step and the LR schedule."""

from __future__ import annotations

import pytest
import torch

from gpt2.config import parse_args
from gpt2.engine import lr_at, step_with_scaler


@pytest.mark.parametrize(("grad", "expect_step"), [(1.0, True), (float("inf"), False), (float("nan"), False)])
def test_scaler_step_reports_skipped_updates(grad: float, expect_step: bool) -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    scaler.scale((weight * torch.full((3,), grad)).sum()).backward()  # d/dweight = grad (x the scale)
    assert step_with_scaler(scaler, optimizer) is expect_step
    assert torch.equal(weight.detach(), torch.ones(3)) is not expect_step  # a skipped step leaves the weight


def test_disabled_scaler_always_steps() -> None:
    weight = torch.nn.Parameter(torch.ones(1))
    weight.grad = torch.ones(1)
    assert step_with_scaler(torch.amp.GradScaler("cpu", enabled=False), torch.optim.SGD([weight], lr=1.0))
    assert weight.item() == 0.0


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    t = parse_args(["--lr", "1e-3", "--min-lr", "1e-4", "--warmup-steps", "4", "--max-steps", "14"]).train
    assert [lr_at(s, t) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(9, t) == pytest.approx(5.5e-4)  # half-way through the decay: the mean of lr and min_lr
    assert lr_at(14, t) == pytest.approx(1e-4) and lr_at(20, t) == pytest.approx(1e-4)
