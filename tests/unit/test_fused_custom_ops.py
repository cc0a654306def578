"""The fused kernels are PyTorch custom ops: torch.compile(fullgraph=True) traces a GPT-2 that uses them as one
graph, forward and backward, and the compiled model computes what the eager one does.

On the CPU the Triton kernels run in the interpreter (tests/conftest.py), where every kernel op is an opaque
custom_op; their GPU form (triton_ops that Inductor traces into) is traced on fake CUDA tensors by
tests/_traced_ops.py. The CUDA extension cannot be built here: its ops are registered by the same helper as a
pure-PyTorch stand-in that is run here, and the real ones are traced through their fakes.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend
from torch.fx.experimental.proxy_tensor import make_fx

from fused_kernels import get_ops
from fused_kernels.custom_ops import bias_gelu_ops
from gpt2.config.schema import ModelConfig
from gpt2.model.gpt import GPT
from tests._fused_helpers import DEVICE, GPU, assert_close

ROOT = Path(__file__).resolve().parents[2]


def _loss_and_grads(model: GPT, forward, idx: torch.Tensor, targets: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss, correct = forward(idx, targets)
    loss.backward()
    return loss.detach(), correct, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("backend,tol", [("aot_eager", 1e-6), pytest.param("inductor", 1e-5, marks=GPU)])
def test_gpt_with_triton_kernels_compiles_to_one_graph(backend, tol):
    """fullgraph=True fails on any graph break (the torch.compiler.disable wrappers these ops replaced broke the
    graph around every kernel call); the one graph calls the kernel ops, and its loss, n_correct and every
    gradient equal eager's (fp32)."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=512)
    model = GPT(cfg, ops=get_ops("triton")).to(DEVICE)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, 2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    graphs = []

    def recording(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=recording)
    loss, correct, grads = _loss_and_grads(model, compiled, idx, targets)
    want_loss, want_correct, want_grads = _loss_and_grads(model, model, idx, targets)
    assert len(graphs) == 1
    called = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {f"gpt2_fused.triton_{op}.default" for op in ("add_layernorm", "bias_gelu", "lm_cross_entropy")
            } <= called, sorted(called)
    assert_close(loss, want_loss, tol, "loss")
    assert correct.item() == want_correct.item()
    for name, g in grads.items():
        assert_close(g, want_grads[name], tol, name)


def _opcheck_cases() -> list:
    from fused_kernels.triton.bias_gelu import bias_gelu_backward_op, bias_gelu_op
    from fused_kernels.triton.cross_entropy import lm_cross_entropy_forward
    from fused_kernels.triton.layernorm import add_layernorm_backward, add_layernorm_forward
    from fused_kernels.triton.matmul_gelu import matmul_bias_gelu

    torch.manual_seed(0)

    def t(*shape: int) -> torch.Tensor:  # an input of a forward op (differentiable)
        return torch.randn(shape, device=DEVICE).requires_grad_()

    def c(*shape: int) -> torch.Tensor:  # an input of a backward op, or of a forward op without gradients
        return torch.randn(shape, device=DEVICE)

    M, K, N = 9, 16, 40
    stats = torch.rand(M, device=DEVICE) + 0.5
    targets = torch.tensor([3, -100, 0, 29, 7, 7, 1, -100, 12], device=DEVICE)
    bf16, f32 = torch.bfloat16, torch.float32
    cases = [
        (bias_gelu_op, (t(M, N), t(N))),
        (bias_gelu_backward_op, (c(M, N), c(M, N), c(N))),
        (bias_gelu_backward_op, (c(M, N), c(M, N), None)),
        (matmul_bias_gelu, (t(M, K), t(N, K), t(N), True)),
        (matmul_bias_gelu, (c(M, K), c(N, K), None, False)),
        (add_layernorm_forward, (t(M, N), t(M, N), t(N), t(N), 1e-5, f32)),
        (add_layernorm_forward, (t(M, N), None, t(N), t(N), 1e-5, f32)),
        (add_layernorm_backward, (c(M, N), c(M, N), c(M, N), c(N), stats, stats)),
        (add_layernorm_backward, (c(M, N), None, c(M, N), c(N), stats, stats)),
        (lm_cross_entropy_forward, (t(M, K), t(N, K), targets, 30, f32, True, 4)),
        (lm_cross_entropy_forward, (t(M, K), t(N, K), targets, 30, bf16, True, 4)),  # as under autocast
        (lm_cross_entropy_forward, (c(M, K), c(N, K), targets, 30, bf16, False, 4)),
    ]
    return [pytest.param(op, args, id=f"{op._name}-{i}") for i, (op, args) in enumerate(cases)]


@pytest.mark.parametrize("op,args", _opcheck_cases())
def test_kernel_ops_pass_opcheck(op, args):
    """Schema (no input mutated or aliased), fake vs real outputs, autograd registration, and AOTAutograd with
    dynamic shapes (eager = compiled, gradients included) for each op."""
    torch.library.opcheck(op, args)


def _gelu_tanh(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")


def _gelu_tanh_grad(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(dy, x + bias, approximate="tanh")


@functools.cache
def _reference_bias_gelu():
    """The CUDA backend's registration (bias_gelu_ops, opaque) with PyTorch standing in for the extension."""
    return bias_gelu_ops("reference", _gelu_tanh, _gelu_tanh_grad, traced=False)


def test_bias_gelu_registration_compiles_and_differentiates():
    op, backward_op = _reference_bias_gelu()
    x, b = torch.randn(2, 7, 33, requires_grad=True), torch.randn(33, requires_grad=True)
    torch.library.opcheck(op, (x, b))
    torch.library.opcheck(backward_op, (torch.randn(2, 7, 33), x.detach(), b.detach()))
    compiled = torch.compile(lambda x, b: op(x, b) * 3, fullgraph=True, backend="aot_eager")
    got = compiled(x, b)
    want = F.gelu(x + b, approximate="tanh") * 3
    assert_close(got, want, 1e-6, "y")
    grads = zip(torch.autograd.grad(got.sum(), [x, b]), torch.autograd.grad(want.sum(), [x, b]))
    for name, (g, w) in zip(("dx", "db"), grads):
        assert_close(g, w, 1e-5, name)


def test_cuda_bias_gelu_ops_trace_without_the_extension():
    """The real CUDA ops, traced forward + backward through their fakes on CPU tensors: no build needed."""
    from fused_kernels.cuda import bias_gelu

    def step(x: torch.Tensor, b: torch.Tensor):
        y = bias_gelu(x, b)
        return (y, *torch.autograd.grad(y.sum(), [x, b]))

    x, b = torch.randn(4, 6, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    gm = make_fx(step, tracing_mode="fake")(x, b)
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "gpt2_fused.cuda_bias_gelu.default" in called and "gpt2_fused.cuda_bias_gelu_backward.default" in called
    y, dx, db = (n.meta["val"] for n in gm.graph.find_nodes(op="output")[0].args[0])
    assert (y.shape, dx.shape, db.shape) == (x.shape, x.shape, b.shape) and db.dtype == b.dtype


@pytest.mark.parametrize("opaque", ["0", "1"])
def test_triton_ops_trace_for_the_gpu(opaque):
    """The triton_op path, as torch.compile takes it on a GPU (tests/_traced_ops.py): the kernels are inlined in
    the graph with no argument copied, the CE op stays opaque; GPT2_OPAQUE_KERNELS=1 makes every op opaque."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"GPT2_OPAQUE_KERNELS": opaque}
    proc = subprocess.run([sys.executable, "-m", "tests._traced_ops"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 9, proc.stdout


def test_a_whole_model_graph_keeps_inductor_s_elementwise_ops_and_the_triton_loss():
    """Each kernel is used only where it measured faster (fused_kernels.triton's docstring): the up-projection is
    cuBLAS + the Triton bias+GELU; where torch.compile traces the whole model Inductor's bias+GELU and add+LayerNorm
    stay but the chunked cross-entropy is kept (faster than Inductor's head there); DeepCompile's graph, where the
    loss was never timed, keeps Inductor's loss and the backend's elementwise ops."""
    from fused_kernels import reference

    ops = get_ops("triton")
    assert {ops.lm_cross_entropy, ops.linear, ops.add_layernorm}.isdisjoint(
        {reference.lm_cross_entropy, reference.linear, reference.add_layernorm})
    whole = get_ops("triton", inductor_head=True, inductor_elementwise=True)
    assert (whole.lm_cross_entropy, whole.linear, whole.add_layernorm) == (
        ops.lm_cross_entropy, reference.linear, reference.add_layernorm)
    deepcompile = get_ops("triton", inductor_head=True)
    assert deepcompile.lm_cross_entropy is reference.lm_cross_entropy and deepcompile.linear is ops.linear
    assert get_ops("none", inductor_head=True, inductor_elementwise=True).lm_cross_entropy is reference.lm_cross_entropy
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    assert_close(ops.linear(x, w, b, True), reference.linear(x, w, b, True), 1e-5, "up-projection")


def test_triton_launch_repro_measures_every_case():
    """benchmarks/repro/triton_launch_in_backward.py (a GPU measurement) runs end to end where the kernels run
    (on CPU under Triton's interpreter): its cases and plumbing are checked, not its numbers."""
    from benchmarks.repro.triton_launch_in_backward import measure

    results = measure(iters=2, device=DEVICE)
    assert len(results) == 8 and all(us > 0 for us in results.values())
    assert {"fwd triton", "fwd+bwd custom-op, backward on the calling thread"} <= results.keys()


@pytest.mark.parametrize("scope, inductor_s", [("model", True), ("blocks", False)])
def test_the_model_s_ops_follow_the_compile_scope(scope: str, inductor_s: bool) -> None:
    """`gpt2.runtime.parallelize.kernel_ops`: Inductor's bias+GELU and add+LayerNorm in torch.compile's whole-model
    graph only; per-block graphs keep the set's kernels, and both keep its cross-entropy."""
    from fused_kernels import reference
    from gpt2.config.cli import parse_args
    from gpt2.runtime.parallelize import kernel_ops

    ops = kernel_ops(parse_args(["--fused-kernels", "triton", "--compile", "--compile-scope", scope]))
    assert (ops.add_layernorm is reference.add_layernorm) is inductor_s
    assert (ops.linear is reference.linear) is inductor_s
    assert ops.lm_cross_entropy is not reference.lm_cross_entropy
