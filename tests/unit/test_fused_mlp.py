"""The whole-MLP op of the cuda backend (`fused_kernels.cuda.mlp`) without a GPU: its two kernels (tested against
fp64 on an H100 by tests/unit/test_gemm_mlp_epilogue.py -m gpu) are swapped for PyTorch versions of the same maths, so
what is checked here is everything around them: the op's registration (schema, fake, autograd), its backward
formula against autograd of the two Linears, and when the model uses it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fused_kernels import REFERENCE_OPS, KernelOps, get_ops
from fused_kernels.cuda import mlp as fused_mlp


def _up(x: torch.Tensor, w_fc_t: torch.Tensor, b_fc: torch.Tensor, h: torch.Tensor, pre: torch.Tensor) -> None:
    p = x.float() @ w_fc_t.float() + b_fc.float()
    pre.copy_(p)
    h.copy_(F.gelu(p, approximate="tanh"))


def _dgelu(dy: torch.Tensor, w_proj: torch.Tensor, pre: torch.Tensor, dpre: torch.Tensor, db: torch.Tensor) -> None:
    d = torch.ops.aten.gelu_backward(dy.float() @ w_proj.float(), pre.float(), approximate="tanh")
    dpre.copy_(d)
    db.add_(d.sum(0))


@pytest.fixture
def cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fused_mlp.KERNELS, "up", _up)
    monkeypatch.setitem(fused_mlp.KERNELS, "dgelu", _dgelu)


def _inputs(tokens: int = 24, d: int = 16, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(tokens, d), (d, 4 * d), (4 * d,), (d, 4 * d), (d,)]  # x, w_fc_t, b_fc, w_proj, b_proj
    return [(torch.randn(*s, generator=g) / math.sqrt(s[0] if len(s) == 2 else 1)).to(dtype).requires_grad_()
            for s in shapes]


def test_the_ops_registration_passes_opcheck(cpu_kernels: None) -> None:
    """Schema, fake (meta) implementation and autograd registration, by torch.library's own checker."""
    x, w_fc_t, b_fc, w_proj, b_proj = _inputs(dtype=torch.float32)
    torch.library.opcheck(fused_mlp.mlp_op, (x, w_fc_t, b_fc, w_proj, b_proj))
    pre = (x @ w_fc_t + b_fc).detach()
    torch.library.opcheck(fused_mlp.dgelu_op, (torch.randn(24, 16), w_proj.detach(), pre))


def test_the_op_trains_the_two_linears_function(cpu_kernels: None) -> None:
    """Output and every gradient (x, both weights, both biases) against autograd of Linear -> GELU -> Linear on the
    same bf16 values in fp32: b_fc's gradient comes from the dgrad's epilogue, the rest from the formula."""
    inputs = _inputs()
    y, _, _ = fused_mlp.mlp_op(*inputs)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    x, w_fc_t, b_fc, w_proj, b_proj = ref_inputs
    ref = F.linear(F.gelu(x @ w_fc_t + b_fc, approximate="tanh"), w_proj, b_proj)
    ref.backward(dy.float())
    assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    for name, got, want in zip(("x", "w_fc_t", "b_fc", "w_proj", "b_proj"), inputs, ref_inputs, strict=True):
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        err = (got.grad.float() - want.grad).abs().max() / want.grad.abs().max()
        assert err <= 0.03, (name, err.item())


def test_the_wrapper_runs_the_two_linears_outside_bf16_autocast() -> None:
    """On CPU (no CUDA autocast) `mlp` calls the unfused pair with nn.Linear's weights, untouched."""
    seen = []
    args = [torch.randn(2, 3, 8), torch.randn(32, 8), torch.randn(32), torch.randn(8, 32), torch.randn(8)]
    out = fused_mlp.mlp(*args, linear_pair=lambda *a: seen.append(a) or a[0])
    assert out is args[0] and len(seen) == 1 and all(a is b for a, b in zip(seen[0], args, strict=True))


def test_the_model_uses_a_backends_whole_mlp_only_where_its_linears_are_plain_modules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """get_ops hands out a backend's whole-MLP op only when asked; the model's MLP calls it when present."""
    from gpt2.config.schema import ModelConfig
    from gpt2.model.gpt import MLP

    calls = []

    def whole(x, w_fc, b_fc, w_proj, b_proj):
        calls.append((w_fc.shape, w_proj.shape))
        return F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_proj, b_proj)

    import fused_kernels

    monkeypatch.setitem(fused_kernels._BACKENDS, "whole-mlp-test", lambda whole_mlp, elementwise: KernelOps(
        name="whole-mlp-test", linear=REFERENCE_OPS.linear, add_layernorm=REFERENCE_OPS.add_layernorm,
        lm_cross_entropy=REFERENCE_OPS.lm_cross_entropy, mlp=whole if whole_mlp else None))
    assert get_ops("whole-mlp-test", whole_mlp=True).mlp is whole and get_ops("whole-mlp-test").mlp is None
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=4, dropout=0.0)
    torch.manual_seed(0)
    fused = MLP(cfg, get_ops("whole-mlp-test", whole_mlp=True)).eval()
    torch.manual_seed(0)
    plain = MLP(cfg, get_ops("whole-mlp-test")).eval()
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(fused(x), plain(x))
    assert calls == [((32, 8), (8, 32))]


@pytest.mark.parametrize(("argv", "allowed"), [
    (["--compile"], False),  # one whole-model graph: cuBLAS and Inductor's fusion ran the MLP faster
    (["--compile", "--compile-scope", "blocks"], True),
    ([], False),  # eager: the op measured 0.988x
    (["--mode", "baseline", "--compile"], False),
    (["--mode", "baseline", "--compile", "--compile-scope", "blocks"], True),
    (["--mode", "hybrid", "--zero-stage", "2", "--compile"], True),
    (["--mode", "hybrid", "--zero-stage", "3", "--compile"], False),  # partitioned Linears
    (["--mode", "hybrid", "--tp-size", "2", "--compile"], False),  # sharded Linears
])
def test_the_whole_mlp_op_is_allowed_only_for_whole_linears_in_per_block_graphs(argv: list[str], allowed: bool) -> None:
    """One decision (gpt2.config.layout.whole_mlp_allowed) for the start-up check and the model build."""
    from gpt2.config.cli import parse_args
    from gpt2.config.layout import RunLayout, whole_mlp_allowed

    cfg = parse_args(argv)
    assert whole_mlp_allowed(cfg) is allowed
    world = 2 if cfg.parallel.tp_size == 2 else 1
    assert RunLayout.resolve(cfg, world_size=world, device="cuda").whole_mlp is allowed


@pytest.mark.parametrize("scope, whole_model_graph", [("model", True), ("blocks", False)])
def test_the_cuda_set_gives_way_to_inductor_in_a_whole_model_graph(monkeypatch: pytest.MonkeyPatch, scope: str,
                                                                  whole_model_graph: bool) -> None:
    """`--fused-kernels cuda` under torch.compile's whole-model graph runs the reference MLP (cuBLAS + Inductor's
    bias+GELU, faster there end to end) and builds neither extension; per-block graphs keep the whole-MLP op
    (extensions stubbed: no GPU here)."""
    import fused_kernels.cuda as cuda_backend
    from fused_kernels import reference
    from gpt2.config.cli import parse_args
    from gpt2.runtime.parallelize import kernel_ops

    built = []
    monkeypatch.setattr(cuda_backend, "check_cuda", lambda: None)
    monkeypatch.setattr(cuda_backend, "load_extension", lambda: built.append("bias+GELU"))
    monkeypatch.setattr(fused_mlp, "hopper", lambda: True)
    monkeypatch.setattr(fused_mlp, "load_wgmma_extension", lambda: built.append("wgmma"))
    ops = kernel_ops(parse_args(["--fused-kernels", "cuda", "--compile", "--compile-scope", scope]))
    assert (ops.linear is reference.linear) is whole_model_graph
    assert (ops.mlp is None) is whole_model_graph
    assert built == ([] if whole_model_graph else ["bias+GELU", "wgmma"])  # nothing built that the run does not call


def test_the_op_backward_fills_no_zeros_for_its_saved_outputs(cpu_kernels: None) -> None:
    """pre and h are outputs only so autograd can save them: their (unused) gradients stay None, no [T, 4d]
    zero tensors a step (the review found two per layer)."""
    seen = []
    backward = fused_mlp._backward

    def spy(ctx, dy, dpre, dh):
        seen.append((dpre, dh))
        return backward(ctx, dy, dpre, dh)

    fused_mlp.mlp_op.register_autograd(spy, setup_context=fused_mlp._setup_context)
    try:
        y, _, _ = fused_mlp.mlp_op(*_inputs())
        y.sum().backward()
    finally:
        fused_mlp.mlp_op.register_autograd(backward, setup_context=fused_mlp._setup_context)
    assert seen == [(None, None)]


def test_the_op_compiles_as_one_graph_with_the_same_gradients(cpu_kernels: None) -> None:
    """AOTAutograd traces the op's forward and its backward (None gradients for pre and h included) without a graph
    break, and the gradients equal eager's."""
    def loss(*args: torch.Tensor) -> torch.Tensor:
        y, _, _ = fused_mlp.mlp_op(*args)
        return (y.float() ** 2).sum()

    eager_inputs, compiled_inputs = _inputs(), _inputs()
    loss(*eager_inputs).backward()
    torch._dynamo.reset()
    torch.compile(loss, backend="aot_eager", fullgraph=True)(*compiled_inputs).backward()
    for a, b in zip(eager_inputs, compiled_inputs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
