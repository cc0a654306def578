"""Engine details that need no process group: the fp16 loss-scaler step with the non-finite guard, the LR schedule,
the compile paths."""

from __future__ import annotations

import pytest
import torch

from gpt2.config.cli import parse_args
from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.engines.base import lr_at
from gpt2.engines.guard import clip_divisor, step_if_finite
from gpt2.model.gpt import GPT
from gpt2.runtime.compiling import INDUCTOR_SETTINGS, compile_forwards, compile_model, compile_whole


@pytest.mark.parametrize(("grad", "applied"), [(1.0, True), (float("inf"), False), (float("nan"), False)])
def test_fp16_scaler_and_guard_skip_the_same_steps(grad: float, applied: bool) -> None:
    """TorchEngine's fp16 step: unscale_, step_if_finite on the global norm, update. The fused AdamW skips on the
    device exactly what scaler.step would, leaving weights, moments and step count, and the scaler still backs
    off from the inf checks unscale_ recorded."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    scaler.scale((weight * torch.full((3,), grad)).sum()).backward()  # d/dweight = grad (x the scale)
    scaler.unscale_(optimizer)
    step_if_finite(optimizer, torch.linalg.vector_norm(weight.grad))
    scaler.update()
    assert torch.equal(weight.detach(), torch.ones(3)) is not applied  # a skipped step leaves the weight
    assert optimizer.state[weight]["step"].item() == float(applied)
    assert scaler.get_scale() == (2.0**4 if applied else 2.0**3)


@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])  # norm below, at and far above the clip
def test_clipping_inside_the_fused_adamw_is_torchs_clip_then_step(scale: float) -> None:
    """TorchEngine's step hands clip_divisor to the fused AdamW instead of clipping first: the same update (to fp32
    rounding: a division by the divisor where torch multiplies by its reciprocal), the gradients left clipped as
    clip_grad_norm_ leaves them, and a non-finite norm still skips the step."""
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    opt, ref_opt = (torch.optim.AdamW(groups(ps), lr=0.01, fused=True) for ps in (ours, ref))
    for _ in range(3):
        grads = [torch.randn(s) * scale for s in shapes]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ours])
        step_if_finite(opt, norm, clip_divisor(norm, 1.0))
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        assert torch.equal(norm, ref_norm)
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-7, atol=0)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    before = [p.detach().clone() for p in ours]
    for p in ours:
        p.grad = torch.full_like(p, float("nan"))
    norm = torch.nn.utils.get_total_norm([p.grad for p in ours])
    step_if_finite(opt, norm, clip_divisor(norm, 1.0))
    assert all(torch.equal(p.detach(), b) for p, b in zip(ours, before))
    assert opt.state[ours[0]]["step"].item() == 3


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    t = parse_args(["--lr", "1e-3", "--min-lr", "1e-4", "--warmup-steps", "4", "--max-steps", "14"]).train
    assert [lr_at(s, t) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(9, t) == pytest.approx(5.5e-4)  # half-way through the decay: the mean of lr and min_lr
    assert lr_at(14, t) == pytest.approx(1e-4) and lr_at(20, t) == pytest.approx(1e-4)


def test_compile_forwards_leaves_hooks_outside_and_room_for_a_graph_per_block() -> None:
    """ZeRO-3's gather hooks stay eager (module __call__ untouched, forward compiled), and Dynamo may compile
    Block.forward once per block (on CUDA, ZeRO-3's gathered parameters fail the previous block's guards)."""
    import torch._dynamo

    # torch's own patch, not monkeypatch: pytest >= 9.2 undoes a module attribute it did not find in __dict__ by
    # delattr, which hides the key in torch's config module (later reads raise AttributeError)
    with torch._dynamo.config.patch(recompile_limit=8):
        model = GPT(ModelConfig(**{**MODEL_PRESETS["gpt2-tiny"], "n_layer": 12}))
        compile_forwards(model)
        assert torch._dynamo.config.recompile_limit >= 12
    assert all("forward" in vars(block) for block in model.blocks)  # an instance attribute: the compiled forward
    assert "forward" in vars(model.ln_f) and "forward" not in vars(model)


@pytest.mark.parametrize("compile_fn", [compile_forwards, compile_model, compile_whole])
def test_every_compile_applies_the_inductor_settings(compile_fn) -> None:
    """Each compile path turns off loop re-ordering after fusion, which mis-compiled GPT-2 Large's whole-model
    training graph on the GPU (the GPU regression is tests/gpu/test_gpu_compile_parity.py)."""
    import torch._inductor.config

    with torch._inductor.config.patch(loop_ordering_after_fusion=True), torch._dynamo.config.patch(recompile_limit=8):
        compile_fn(GPT(ModelConfig(**MODEL_PRESETS["gpt2-tiny"])))
        assert {k: getattr(torch._inductor.config, k) for k in INDUCTOR_SETTINGS} == INDUCTOR_SETTINGS


@pytest.mark.parametrize(("device", "cpp"), [("cuda", True), ("cpu", False)])
def test_the_parts_compile_with_the_layouts_launch_code(device: str, cpp: bool) -> None:
    """`parallelize` compiles the blocks with the wrapper `RunLayout.inductor_cpp_wrapper` chose (--compile-wrapper
    auto: C++ on CUDA, where per-block graphs are host-bound); nothing runs here, the setting is what Inductor reads
    when the first step compiles."""
    import torch._inductor.config

    from gpt2.config.layout import RunLayout
    from gpt2.runtime.parallelize import parallelize
    from parallel.dims import ParallelDims

    layout = RunLayout.resolve(parse_args(["--mode", "hybrid", "--zero-engine", "fsdp2", "--compile"]), world_size=1,
                               device=device)
    with torch._inductor.config.patch(cpp_wrapper=not cpp), torch._dynamo.config.patch(recompile_limit=8):
        parallelize(GPT(layout.cfg.model), layout, ParallelDims(world_size=1, rank=0))
        assert torch._inductor.config.cpp_wrapper is cpp
