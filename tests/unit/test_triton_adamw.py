"""The Triton AdamW (`fused_kernels.triton.adamw.adamw_step`) against torch's AdamW on the same state.

On a CPU-only machine it runs in Triton's interpreter (tests/conftest.py); with a GPU, compiled.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fused_kernels.triton import adamw
from fused_kernels.triton.adamw import BLOCK, TABLES, TritonAdamW, adamw_step, grad_norm
from tests._fused_helpers import DEVICE

SHAPES = [(37, 129), (129,), (3, BLOCK + 5), (1,)]  # tensors shorter and longer than a program's block
WHOLE_WORDS = [(32, 64), (128,), (3, BLOCK + 4), (4,)]  # every tensor spans whole 16-byte words: vector hints


def _model(seed: int = 0, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE)) for s in shapes]


def _optimizer(params: list[torch.nn.Parameter], lr: float = 1e-2) -> torch.optim.AdamW:
    return torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(DEVICE)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("shapes, aligned", [(SHAPES, False), (WHOLE_WORDS, True)])
def test_matches_torch_adamw_with_the_clip_divisor(shapes: list[tuple[int, ...]], aligned: bool) -> None:
    """Three steps with an lr change and a clip divisor: parameters, both moments and the step counts as torch's
    AdamW leaves them after dividing every gradient by the divisor; the gradients themselves are not written. The
    kernel's vector-width hints are on only where every tensor of the group allows them."""
    ours, ref = _model(shapes=shapes), _model(shapes=shapes)
    opt, opt_ref = _optimizer(ours), _optimizer(ref)
    for step, divisor in enumerate([1.0, 3.5, 1.25]):
        _set_grads(ours, step)
        _set_grads(ref, step)
        grads_before = [p.grad.clone() for p in ours]
        for group, group_ref in zip(opt.param_groups, opt_ref.param_groups):
            group["lr"] = group_ref["lr"] = 1e-2 / (step + 1)
        adamw_step(opt, torch.tensor(divisor, device=DEVICE), torch.zeros((), device=DEVICE))
        for p in ref:
            p.grad.div_(divisor)
        opt_ref.step()
        for p, p_ref, g in zip(ours, ref, grads_before):
            _close(p.detach(), p_ref.detach())
            assert torch.equal(p.grad, g)
            for key in ("exp_avg", "exp_avg_sq"):
                _close(opt.state[p][key], opt_ref.state[p_ref][key])
            assert float(opt.state[p]["step"]) == float(opt_ref.state[p_ref]["step"]) == step + 1
    assert [t.aligned for t in opt.__dict__[TABLES].values()] == [aligned, aligned]


def test_a_non_finite_step_changes_nothing_and_the_state_is_torchs() -> None:
    params = _model()
    opt = _optimizer(params)
    _set_grads(params, 0)
    adamw_step(opt, None, torch.zeros((), device=DEVICE))
    before = {k: v.clone() for k, v in enumerate(p.detach() for p in params)}
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    _set_grads(params, 1)
    adamw_step(opt, None, torch.ones((), device=DEVICE))  # found_inf
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), before[i]) and torch.equal(opt.state[p]["exp_avg"], moments[i])
        assert float(opt.state[p]["step"]) == 1.0
    # the state dict is torch's: a torch AdamW loads it and steps on as ours does
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = _optimizer(ref_params)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict would share the moments
    for p, p_ref in zip(params, ref_params):
        p_ref.grad = p.grad.clone()
    adamw_step(opt, None, torch.zeros((), device=DEVICE))  # tables rebuilt for nothing new: same state
    ref.step()
    for p, p_ref in zip(params, ref_params):
        _close(p.detach(), p_ref.detach())


@pytest.mark.parametrize("missing", [0, 2])
def test_a_parameter_without_a_gradient_is_left_out(missing: int) -> None:
    params = _model()
    opt = _optimizer(params)
    _set_grads(params, 0)
    params[missing].grad = None
    kept = params[missing].detach().clone()
    adamw_step(opt, None, torch.zeros((), device=DEVICE))
    assert torch.equal(params[missing].detach(), kept) and not opt.state[params[missing]]


def test_a_gradient_off_a_16_byte_word_turns_the_vector_hints_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters and moments allow the hints (checked once, in the tables); gradients are new tensors every
    step, so their addresses are checked at each launch."""
    launches: list[bool] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, ALIGNED, **kwargs: launches.append(ALIGNED)

    monkeypatch.setattr(adamw, "adamw_kernel", Recorder())
    params = _model(shapes=WHOLE_WORDS)
    opt = _optimizer(params)
    _set_grads(params, 0)
    adamw_step(opt, None, torch.zeros((), device=DEVICE))
    buffer = torch.zeros(params[0].numel() + 1, device=DEVICE)
    params[0].grad = buffer[1:].view(params[0].shape)  # 4 bytes past an aligned allocation
    adamw_step(opt, None, torch.zeros((), device=DEVICE))
    assert launches == [True, True, False, True]  # per group: [matrices, vectors]


@pytest.mark.parametrize("shapes, aligned", [(SHAPES, False), (WHOLE_WORDS, True)])
def test_grad_norm_is_the_global_norm_of_the_gradients_it_steps(shapes: list[tuple[int, ...]], aligned: bool) -> None:
    """Every block's sum of squares once (blocks shorter than BLOCK, several blocks a tensor), a parameter without a
    gradient left out as the update leaves it out."""
    params = _model(shapes=shapes)
    opt = _optimizer(params)
    _set_grads(params, 0)
    params[1].grad = None
    exact = torch.stack([p.grad.double().square().sum() for p in params if p.grad is not None]).sum().sqrt()
    norm = grad_norm(opt)
    assert norm.dtype == torch.float32 and norm.shape == ()
    torch.testing.assert_close(norm.double(), exact, rtol=1e-6, atol=0)
    assert [t.aligned for t in opt.__dict__[TABLES].values()] == [aligned, aligned]


def test_a_shard_is_stepped_as_its_part_of_the_whole() -> None:
    """`shard` picks the tensors the kernels read and write (as a DTensor's local shard): a shard's update is the
    whole parameter's, restricted to it; the rest stays as it was. The norm is the shards'."""
    def rows_after_first(t: torch.Tensor) -> torch.Tensor:
        return t[1:]  # contiguous: rows 1.. of a contiguous tensor

    shapes = [(5, 129), (3, BLOCK + 4), (2,), (1,)]  # the last one's shard is empty
    ours, ref = _model(shapes=shapes), _model(shapes=shapes)
    opt = TritonAdamW([{"params": ours[:2], "weight_decay": 0.1}, {"params": ours[2:], "weight_decay": 0.0}],
                      lr=1e-2, betas=(0.9, 0.95), shard=rows_after_first)
    opt_ref = _optimizer(ref)
    first_rows = [p.detach()[:1].clone() for p in ours]
    for step in range(2):
        _set_grads(ours, step)
        _set_grads(ref, step)
        shard_norm = torch.stack([g.double()[1:].square().sum() for g in (p.grad for p in ours)]).sum().sqrt()
        torch.testing.assert_close(opt.grad_norm().double(), shard_norm, rtol=1e-6, atol=0)
        opt.step()
        opt_ref.step()
    for p, p_ref, row in zip(ours, ref, first_rows):
        assert torch.equal(p.detach()[:1], row)
        _close(p.detach()[1:], p_ref.detach()[1:])
        _close(opt.state[p]["exp_avg"][1:], opt_ref.state[p_ref]["exp_avg"][1:])
        assert not opt.state[p]["exp_avg"][:1].any()


def test_triton_adamw_step_reads_the_divisor_and_found_inf_a_caller_sets() -> None:
    """What `gpt2.engines.guard.step_if_finite` hands torch's fused AdamW, read the same way."""
    ours, ref = _model(), _model()
    opt = TritonAdamW([{"params": ours[:2], "weight_decay": 0.1}, {"params": ours[2:], "weight_decay": 0.0}],
                      lr=1e-2, betas=(0.9, 0.95))
    opt_ref = _optimizer(ref)
    _set_grads(ours, 0)
    _set_grads(ref, 0)
    opt.grad_scale, opt.found_inf = torch.tensor(2.5, device=DEVICE), torch.zeros((), device=DEVICE)
    opt.step()
    for p in ref:
        p.grad.div_(2.5)
    opt_ref.step()
    for p, p_ref in zip(ours, ref):
        _close(p.detach(), p_ref.detach())
    before = [p.detach().clone() for p in ours]
    opt.found_inf = torch.ones((), device=DEVICE)
    opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ours, before))


def test_the_gradient_table_is_copied_only_when_the_addresses_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The norm and the update of a step share one copy of the gradients' table; the same gradients again (DDP's
    bucket views) need none; new gradients at new addresses get a new one, which the update reads (the steps match
    torch's)."""
    copies: list[int] = []
    table = adamw._table
    monkeypatch.setattr(adamw, "_table", lambda values, *args: copies.append(len(values)) or table(values, *args))
    ours, ref = _model(), _model()
    opt, opt_ref = _optimizer(ours), _optimizer(ref)
    per_step = []
    for seed, new_tensors in [(0, True), (1, True), (1, False)]:  # the last step: step 1's gradient tensors again
        if new_tensors:
            _set_grads(ours, seed)
        _set_grads(ref, seed)
        copies.clear()
        grad_norm(opt)
        adamw_step(opt, None, torch.zeros((), device=DEVICE))
        opt_ref.step()
        per_step.append(len(copies))
    assert per_step[1:] == [2, 0]  # a gradient table per group at step 1, none at step 2 (step 0 built the rest)
    for p, p_ref in zip(ours, ref):
        _close(p.detach(), p_ref.detach())


def test_a_step_reads_nothing_back_to_the_host() -> None:
    """No `.item()` (a device sync each step, which stalled the step on a GPU) in the norm or the update."""
    from torch.profiler import ProfilerActivity, profile

    params = _model()
    opt = TritonAdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2)
    _set_grads(params, 0)
    opt.step()  # tables built
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        norm = opt.grad_norm()
        opt.found_inf, opt.grad_scale = (~torch.isfinite(norm)).float(), torch.clamp(norm, min=1.0)
        opt.step()
    assert [e.key for e in prof.key_averages() if e.key in ("aten::item", "aten::_local_scalar_dense")] == []


def test_tables_follow_a_parameter_or_state_tensor_swapped_in_place_of_another() -> None:
    """`.data =` (or load_state_dict(assign=True), FSDP2 resharding) moves a parameter's storage, and a state tensor
    can be replaced alone: the next step updates the new tensors, not the freed ones."""
    ours, ref = _model(), _model()
    opt, opt_ref = _optimizer(ours), _optimizer(ref)
    for step in range(3):
        if step == 1:
            ours[0].data = ours[0].data.clone()
            opt.state[ours[2]]["exp_avg_sq"] = opt.state[ours[2]]["exp_avg_sq"].clone()
        _set_grads(ours, step)
        _set_grads(ref, step)
        adamw_step(opt, None, torch.zeros((), device=DEVICE))
        opt_ref.step()
    for p, p_ref in zip(ours, ref):
        _close(p.detach(), p_ref.detach())
        _close(opt.state[p]["exp_avg_sq"], opt_ref.state[p_ref]["exp_avg_sq"])


def test_an_empty_first_group_and_no_gradients() -> None:
    params = _model()
    opt = TritonAdamW([{"params": []}, {"params": params}], lr=1e-2)
    assert float(opt.grad_norm()) == 0.0  # no gradient yet
    _set_grads(params, 0)
    opt.step()
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)
