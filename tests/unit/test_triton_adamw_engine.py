"""The engines' optimizer step with `--optimizer triton` (`RunLayout.triton_adamw`): the Triton norm and
update (`fused_kernels.triton.adamw`) step the engine's own AdamW state as torch's fused AdamW steps it, clipping and
the non-finite guard included. Both engines get the same weights and the same gradients, so only the step differs.

On a CPU-only machine the kernels run in Triton's interpreter (tests/conftest.py); with a GPU, compiled (single).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from fused_kernels.triton.adamw import GRAD_TABLES, TABLES
from gpt2.config.cli import parse_args
from gpt2.engines.build import build_engine
from gpt2.engines.fsdp2_engine import FSDP2Engine
from gpt2.engines.torch_engine import TorchEngine
from gpt2.runtime.distributed import init_distributed
from tests._fused_helpers import DEVICE

TINY = ["--model", "gpt2-tiny", "--n-layer", "1", "--n-embd", "16", "--batch-size", "2", "--seq-len", "16",
        "--grad-clip", "1.0"]
FSDP2 = ["--mode", "hybrid", "--zero-engine", "fsdp2"]


def _engine(optimizer: str, mode: list[str] = []) -> TorchEngine:  # noqa: B006 (read only)
    torch.manual_seed(0)
    device = "cpu" if mode else DEVICE.type  # FSDP2 and DDP here: one gloo rank, on the CPU
    engine = build_engine(*init_distributed(parse_args([*TINY, *mode, "--device", device, "--optimizer", optimizer])))
    assert isinstance(engine, FSDP2Engine if mode == FSDP2 else TorchEngine)
    assert engine.layout.triton_adamw is (optimizer == "triton")
    return engine


def _params(engine: TorchEngine) -> list[torch.nn.Parameter]:
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def _set_grads(engine: TorchEngine, step: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in _params(engine):
        grad = (torch.randn(p.shape, generator=gen) * scale).to(p.device)
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _state(engine: TorchEngine) -> list[torch.Tensor]:
    return [_full(t) for p in _params(engine) for t in (p.detach(), *engine.optimizer.state[p].values())]


def _check_triton_step_matches_the_fused_adamw_step(ours: TorchEngine, ref: TorchEngine, triton_norm: bool) -> None:
    """triton_norm: the norm is the Triton kernels' (exact to fp32 rounding); else the engine's own."""
    for p, p_ref in zip(_params(ours), _params(ref)):
        assert torch.equal(_full(p), _full(p_ref))
    for step, scale in enumerate([1e-4, 0.05, float("inf"), 0.02]):  # unclipped, clipped, skipped, clipped
        _set_grads(ours, step, scale)
        _set_grads(ref, step, scale)
        exact = torch.stack([_full(p.grad).double().square().sum() for p in _params(ours)]).sum().sqrt()
        norm, norm_ref = ours.optimizer_step(), ref.optimizer_step()
        torch.testing.assert_close(norm.double(), exact, rtol=1e-6 if triton_norm else 1e-4, atol=0, equal_nan=True)
        torch.testing.assert_close(norm, norm_ref, rtol=1e-4, atol=0, equal_nan=True)  # torch's: fp32 in a row (CPU)
        for t, t_ref in zip(_state(ours), _state(ref), strict=True):
            torch.testing.assert_close(t, t_ref, rtol=1e-4, atol=1e-7)
        assert all(p.grad is None for p in _params(ours))  # zero_grad as in the fused path
    assert TABLES in ours.optimizer.__dict__  # the Triton kernels stepped it
    assert ours.optimizer.state[_params(ours)[0]]["step"].item() == 3  # the skipped step not counted


def test_triton_step_matches_the_fused_adamw_step_with_clip_and_guard() -> None:
    _check_triton_step_matches_the_fused_adamw_step(_engine("triton"), _engine("torch"), triton_norm=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="one gloo rank: FSDP2 on the CPU, kernels interpreted")
def test_fsdp2_triton_step_runs_on_the_local_shards(gloo_launch) -> None:
    """FSDP2 (one rank): the parameters, gradients and moments are DTensors; the Triton step reads their local
    shards and the state stays DTensors, as LocalShardAdamW's does. The norm stays the engine's (over DP, TP-aware)."""
    ours, ref = _engine("triton", FSDP2), _engine("torch", FSDP2)
    _check_triton_step_matches_the_fused_adamw_step(ours, ref, triton_norm=False)
    assert all(isinstance(ours.optimizer.state[p]["exp_avg"], DTensor) for p in _params(ours))


@pytest.mark.parametrize("optimizer", ["torch", "triton"])
def test_only_optimizer_triton_steps_with_the_triton_adamw(optimizer: str) -> None:
    engine = _engine(optimizer)
    _set_grads(engine, 0, 1e-3)
    engine.optimizer_step()
    assert (TABLES in engine.optimizer.__dict__) is (optimizer == "triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="one gloo rank: DDP on the CPU, kernels interpreted")
def test_ddp_triton_steps_match_with_gradients_in_ddp_buckets(gloo_launch) -> None:
    """DDP (one gloo rank) with real backwards: the gradients are views into DDP's buckets, at the same addresses
    every step once DDP has rebuilt them, so the kernels' gradient table is reused; the steps still match torch's."""
    engines = [_engine(optimizer, ["--mode", "baseline"]) for optimizer in ("triton", "torch")]
    x = torch.randint(0, 512, (3, 2, 16), generator=torch.Generator().manual_seed(0))
    ours, ref = engines
    first_tables = None
    for step in range(3):
        norms = []
        for engine in engines:
            engine.forward_backward(x[step], x[(step + 1) % 3], last_micro_step=True)
            norms.append(engine.optimizer_step())
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-4, atol=0)
        tables = [table for _, table in ours.optimizer.__dict__[GRAD_TABLES].values()]
        if step == 1:  # DDP rebuilds its buckets once, after the first step
            first_tables = tables
        assert len(tables) == 2 and (step < 2 or all(a is b for a, b in zip(tables, first_tables)))  # no copy since
    for t, t_ref in zip(_state(ours), _state(ref), strict=True):
        torch.testing.assert_close(t, t_ref, rtol=1e-4, atol=1e-6)
