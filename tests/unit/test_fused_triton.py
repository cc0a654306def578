"""Triton kernels against fp64 PyTorch references: forward and every gradient, odd shapes, three dtypes.

On a CPU-only machine they run in Triton's interpreter (tests/conftest.py); with a GPU, compiled.
Shapes are deliberately not multiples of the block sizes. Outputs start as NaN (`poison`).
"""

from __future__ import annotations

import subprocess
import sys
import weakref

import pytest
import torch

from fused_kernels import reference
from fused_kernels.triton.bias_gelu import bias_gelu
from fused_kernels.triton.cross_entropy import lm_cross_entropy
from fused_kernels.triton.layernorm import add_layernorm
from fused_kernels.triton.matmul_gelu import linear_gelu
from tests._fused_helpers import DEVICE, DTYPE_TOLS, GPU, assert_close, poison  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("poison")


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    """Gradients of <out, g> for a fixed random g (the same g for kernel and reference)."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.device)
    return list(torch.autograd.grad((out.double() * g).sum(), inputs))


def _leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(DEVICE, dtype).requires_grad_()


def _ref_leaves(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().double().requires_grad_() for t in ts]


@pytest.mark.parametrize("dtype,tol", DTYPE_TOLS)
@pytest.mark.parametrize("shape", [(37, 129), (2, 3, 64), (5, 1500), pytest.param((4096, 5120), marks=GPU)])
def test_bias_gelu(shape, dtype, tol):
    torch.manual_seed(0)
    x, b = _leaf(torch.randn(shape) * 2, dtype), _leaf(torch.randn(shape[-1]), dtype)
    y = bias_gelu(x, b)
    xr, br = _ref_leaves([x, b])
    yr = reference.linear(xr, torch.eye(shape[-1], dtype=torch.float64, device=DEVICE), br, gelu=True)
    assert y.dtype == dtype
    assert_close(y, yr, tol, "y")
    for name, got, want in zip(("dx", "db"), _grads(y, [x, b]), _grads(yr, [xr, br])):
        assert_close(got, want, tol * (10 if name == "db" else 1), name)  # db sums rows of rounded dx


@pytest.mark.parametrize("dtype,tol", DTYPE_TOLS)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("shape", [(37, 129), (3, 5, 64), pytest.param((8, 1024, 1280), marks=GPU)])
def test_add_layernorm(shape, with_residual, dtype, tol):
    torch.manual_seed(0)
    n = shape[-1]
    x = _leaf(torch.randn(shape) * 3 + 1, dtype)
    res = _leaf(torch.randn(shape), dtype) if with_residual else None
    w, b = _leaf(torch.randn(n) * 0.5 + 1, dtype), _leaf(torch.randn(n) * 0.1, dtype)
    y, r = add_layernorm(x, res, w, b, 1e-5)
    inputs = [t for t in (x, res, w, b) if t is not None]
    ref_inputs = _ref_leaves(inputs)
    xr, resr = ref_inputs[0], (ref_inputs[1] if with_residual else None)
    yr, rr = reference.add_layernorm(xr, resr, ref_inputs[-2], ref_inputs[-1], 1e-5)
    assert y.dtype == dtype and r.dtype == dtype
    if not with_residual:
        assert r is x  # the reference returns x itself
    assert_close(y, yr, tol, "y")
    assert_close(r, rr, tol, "r")
    # both outputs feed the loss, as in a GPT-2 block (h feeds attention/MLP, r the residual stream)
    g_y = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    g_r = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    got = torch.autograd.grad((y.double() * g_y).sum() + (r.double() * g_r).sum(), inputs)
    want = torch.autograd.grad((yr * g_y).sum() + (rr * g_r).sum(), ref_inputs)
    names = ["dx", "dres", "dw", "db"] if with_residual else ["dx", "dw", "db"]
    for name, a, e in zip(names, got, want):
        assert_close(a, e, tol * (10 if name in ("dw", "db") else 1), name)  # dw/db sum over rows


def test_add_layernorm_mixed_dtypes_as_under_autocast():
    """In the model the attention output is bf16 and the residual stream fp32: r is fp32, grads keep dtypes."""
    torch.manual_seed(0)
    x, res = _leaf(torch.randn(37, 129), torch.bfloat16), _leaf(torch.randn(37, 129), torch.float32)
    w, b = _leaf(torch.ones(129), torch.float32), _leaf(torch.zeros(129), torch.float32)
    y, r = add_layernorm(x, res, w, b, 1e-5)
    yr, rr = reference.add_layernorm(x.detach().double(), res.detach().double(), w.double(), b.double(), 1e-5)
    assert r.dtype == torch.float32 and y.dtype == torch.float32
    assert_close(y, yr, 1e-5, "y")
    dx, dres = torch.autograd.grad(y.sum() + r.sum(), [x, res])
    assert dx.dtype == torch.bfloat16 and dres.dtype == torch.float32



def test_add_layernorm_under_autocast_emits_what_the_next_matmul_reads():
    """Under autocast the normalised output comes out in the autocast dtype, rounded as autocast's cast of the fp32
    output would round it, and the gradients are those through that cast."""
    from fused_kernels.triton.layernorm import INTERPRETED, add_layernorm_forward

    torch.manual_seed(0)
    x, res = _leaf(torch.randn(37, 129), torch.bfloat16), _leaf(torch.randn(37, 129), torch.float32)
    w, b = _leaf(torch.randn(129), torch.float32), _leaf(torch.randn(129), torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y, r = add_layernorm(x, res, w, b, 1e-5)
    y32, r32 = add_layernorm_forward(x, res, w, b, 1e-5, torch.float32)[:2]  # the kernel's fp32 output
    assert y.dtype == torch.bfloat16 and r.dtype == torch.float32
    # compiled, Triton's cast rounds to nearest even, as torch's does; the interpreter's truncates (one ulp)
    ulp = 2.0 ** -7 if INTERPRETED else 0.0
    torch.testing.assert_close(y.float(), y32.to(torch.bfloat16).float(), rtol=ulp, atol=0)
    assert torch.equal(r, r32)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device, torch.bfloat16)
    fused = torch.autograd.grad((y * g).sum() + r.sum(), [x, res, w, b])
    y32, r32 = add_layernorm_forward(x, res, w, b, 1e-5, torch.float32)[:2]
    cast = torch.autograd.grad((y32.to(torch.bfloat16) * g).sum() + r32.sum(), [x, res, w, b])
    for name, got, want in zip(("dx", "dres", "dw", "db"), fused, cast):
        assert got.dtype == want.dtype and torch.equal(got, want), name

MATMUL_CASES = [
    pytest.param(shape, *dt.values, id=f"{'x'.join(map(str, shape))}-{dt.id}")
    for shape in [(37, 71, 129), (100, 40, 72)] for dt in DTYPE_TOLS
] + [  # GPT-2 Large's up-projection, bf16 only: every (K, dtype) compiles the autotuned kernel anew
    pytest.param((M, 1280, 5120), torch.bfloat16, 2e-2, marks=GPU, id=f"{M}x1280x5120-bf16") for M in (1000, 8192)]


@pytest.mark.parametrize("shape,dtype,tol", MATMUL_CASES)
def test_matmul_bias_gelu(shape, dtype, tol):
    M, K, N = shape
    torch.manual_seed(0)
    x = _leaf(torch.randn(M, K), dtype)
    w = _leaf(torch.randn(N, K) / K**0.5, dtype)
    b = _leaf(torch.randn(N) * 0.1, dtype)
    y = linear_gelu(x, w, b)
    refs = _ref_leaves([x, w, b])
    yr = reference.linear(*refs, gelu=True)
    assert y.dtype == dtype
    assert_close(y, yr, tol, "y")
    for name, got, want in zip(("dx", "dw", "db"), _grads(y, [x, w, b]), _grads(yr, refs)):
        assert_close(got, want, tol * 10, name)  # sums of M or N rounded products


def test_matmul_bias_gelu_3d_input_and_no_grad():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 19, 40, device=DEVICE), torch.randn(72, 40, device=DEVICE), torch.randn(72, device=DEVICE)
    with torch.no_grad():
        y = linear_gelu(x, w, b)
    assert_close(y, reference.linear(x.double(), w.double(), b.double(), gelu=True), 1e-5, "y")


def _ce_case(N: int, d: int, V: int, Vp: int, dtype: torch.dtype):
    """Inputs with ignored rows and with rows whose target is the argmax (so n_correct is not trivially 0)."""
    torch.manual_seed(0)
    hidden = torch.randn(N, d) * 2
    weight = torch.randn(Vp, d) / d**0.5
    targets = torch.randint(0, V, (N,))
    targets[::5] = (hidden.to(dtype) @ weight.to(dtype).T)[::5, :V].argmax(-1)  # correct predictions
    targets[3::7] = -100  # ignored
    return _leaf(hidden, dtype), _leaf(weight, dtype), targets.to(DEVICE)


@pytest.mark.parametrize("dtype,tol", DTYPE_TOLS[:2])
@pytest.mark.parametrize(
    "N,d,V,Vp,chunk_rows",
    [(37, 24, 300, 384, 16), (37, 24, 300, 384, None), (20, 32, 256, 256, 7),
     pytest.param(2048, 768, 50257, 50304, None, marks=GPU)])
def test_lm_cross_entropy(N, d, V, Vp, chunk_rows, dtype, tol):
    hidden, weight, targets = _ce_case(N, d, V, Vp, dtype)
    loss, correct = lm_cross_entropy(hidden, weight, targets, V, chunk_rows=chunk_rows)
    hr, wr = _ref_leaves([hidden, weight])
    loss_r, correct_r = reference.lm_cross_entropy(hr, wr, targets, V)
    _, correct_same_dtype = reference.lm_cross_entropy(hidden.detach(), weight.detach(), targets, V)
    assert correct.item() == correct_same_dtype.item() > 0  # argmax over the same rounded logits
    assert abs(correct.item() - correct_r.item()) <= N // 10  # fp64 logits may break near-ties differently
    assert_close(loss, loss_r, tol, "loss")
    got = torch.autograd.grad(loss, [hidden, weight])
    want = torch.autograd.grad(loss_r, [hr, wr])
    assert (got[1][V:] == 0).all(), "padded vocabulary rows must get no gradient"
    for name, a, e in zip(("dhidden", "dweight"), got, want):
        assert a.dtype == dtype
        assert_close(a, e, tol, name)


def test_lm_cross_entropy_scales_incoming_gradient():
    hidden, weight, targets = _ce_case(37, 24, 300, 384, torch.float32)
    loss, _ = lm_cross_entropy(hidden, weight, targets, 300, chunk_rows=16)
    (g,) = torch.autograd.grad(3.0 * loss, [hidden])
    (g_ref,) = torch.autograd.grad(3.0 * reference.lm_cross_entropy(hidden, weight, targets, 300)[0], [hidden])
    assert_close(g, g_ref, 1e-5, "3 * dhidden")


def test_lm_cross_entropy_holds_one_chunk_of_logits_at_a_time(monkeypatch):
    """The chunk loop frees each [C, Vp] chunk before the next one's matmul allocates (two alive at once would
    double the op's peak, which the memory planner counts as one chunk)."""
    hidden, weight, targets = _ce_case(37, 24, 300, 384, torch.float32)
    chunks: list[weakref.ref[torch.Tensor]] = []
    most_alive = 0
    matmul = torch.Tensor.__matmul__

    def counting_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        nonlocal most_alive
        out = matmul(a, b)
        if out.shape[-1] == weight.shape[0]:  # a logits chunk [C, Vp]
            chunks.append(weakref.ref(out))
            most_alive = max(most_alive, sum(ref() is not None for ref in chunks))
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", counting_matmul)
    lm_cross_entropy(hidden, weight, targets, 300, chunk_rows=8)
    assert len(chunks) == 5 and most_alive == 1, (len(chunks), most_alive)


def test_registry_import_does_not_import_triton_or_build_cuda():
    code = ("import sys, torch\n"
            "before = {m for m in ('triton', 'torch.utils.cpp_extension') if m in sys.modules}\n"
            "import fused_kernels\n"
            "after = {m for m in ('triton', 'torch.utils.cpp_extension') if m in sys.modules}\n"
            "assert after == before, after - before\n"
            "assert 'fused_kernels.triton' not in sys.modules and 'fused_kernels.cuda' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_triton_backend_without_gpu_or_interpreter_is_a_clear_error():
    code = ("import fused_kernels\n"
            "try:\n    fused_kernels.get_ops('triton')\n"
            "except fused_kernels.KernelUnavailableError as e:\n    print(e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "TRITON_INTERPRET=1" in out and "GPU" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_triton_optimizer_without_gpu_or_interpreter_is_a_clear_error():
    code = ("from gpt2.config.cli import parse_args\nfrom gpt2.config.schema import ConfigError\n"
            "from gpt2.engines.build import check_backends\n"
            "try:\n    check_backends(parse_args(['--optimizer', 'triton']))\n"
            "except ConfigError as e:\n    print(e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("--optimizer triton (what --optimizer auto picks under --fused-kernels triton or cuda) "
                          "needs a CUDA GPU") and "use --optimizer torch" in out, out


def test_triton_backend_ops():
    from fused_kernels import get_ops

    ops = get_ops("triton")
    assert ops.name == "triton"
    # the kernels' functions themselves: custom ops inside, so torch.compile needs no wrapper around them
    assert ops.add_layernorm is add_layernorm and ops.lm_cross_entropy is lm_cross_entropy
