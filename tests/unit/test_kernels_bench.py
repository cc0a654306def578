"""benchmarks.kernels off the GPU: the "where ours lose" summary, and the Liger-Kernel rows' glue (a stand-in
`liger_kernel` with the real package's function names and keywords, since Liger's Triton kernels do not run in the
CPU interpreter) computes our reference functions."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from benchmarks import kernels
from fused_kernels import reference


def _row(kernel, pass_, impl, ms, mem=None):
    r = {"kernel": kernel, "shape": "s [1]", "pass": pass_, "impl": impl, "ms": ms}
    if mem is not None:
        r["peak_mem_MiB"] = mem
    return r


def test_where_ours_lose():
    rows = [_row("ce", "fwd+bwd", "eager", 11.0, 4700.0), _row("ce", "fwd+bwd", "torch.compile", 6.5, 929.0),
            _row("ce", "fwd+bwd", "triton", 7.5, 655.0), _row("ce", "fwd+bwd", "liger", 7.0, 300.0),
            _row("ln", "fwd", "eager", 0.04), _row("ln", "fwd", "triton", 0.02), _row("ln", "fwd", "cuda", 0.03),
            {"kernel": "gelu", "shape": "s [1]", "pass": "fwd", "impl": "liger", "error": "NotImplementedError: x"}]
    assert kernels.where_ours_lose(rows) == [
        "- ce s [1] fwd+bwd: time: ours (triton) 7.5 ms vs torch.compile 6.5 ms (1.15x slower)",
        "- ce s [1] fwd+bwd: memory: ours (triton) 655.0 MiB vs liger 300.0 MiB"]
    assert kernels.where_ours_lose(rows[4:]) == ["- nowhere among the measured rows"]


@pytest.fixture
def fake_liger(monkeypatch):
    """liger_kernel.transformers.functional with the two functions the benchmark calls, in plain PyTorch."""
    calls = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, *, accum_dtype=None,
                                         return_token_accuracy=False, **_):
        calls.append((tuple(weight.shape), accum_dtype, input.requires_grad))
        logits = input @ weight.T
        out = types.SimpleNamespace(loss=F.cross_entropy(logits.float(), target),
                                    token_accuracy=(logits.argmax(-1) == target).float().mean())
        return out if return_token_accuracy else out.loss

    def liger_layer_norm(X, W, B, eps):
        return F.layer_norm(X, (X.shape[-1],), W, B, eps)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    functional.liger_layer_norm = liger_layer_norm
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    return calls


def test_liger_rows_compute_our_functions(fake_liger):
    torch.manual_seed(0)
    impls = kernels.KERNELS["cross_entropy"][1]
    h = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(kernels.VOCAB_PADDED, 8, requires_grad=True)
    t = torch.randint(0, kernels.VOCAB, (16,))
    want = reference.lm_cross_entropy(h, w, t, kernels.VOCAB)[0]
    for name, accum in (("liger", None), ("liger-fp32acc", torch.float32)):
        loss, acc = impls[name]()(h, w, t)
        torch.testing.assert_close(loss, want)
        assert fake_liger[-1] == ((kernels.VOCAB, 8), accum, True)  # the real vocabulary rows only
    with torch.no_grad():  # forward-only rows: no gradient work inside Liger
        impls["liger"]()(h, w, t)
    assert fake_liger[-1][2] is False

    x, r = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    wn, b = torch.randn(8), torch.randn(8)
    got = kernels.KERNELS["layernorm"][1]["liger"]()(x, r, wn, b)
    for g, e in zip(got, kernels._eager_layernorm(x, r, wn, b), strict=True):
        torch.testing.assert_close(g, e)
    with pytest.raises(NotImplementedError, match="no \\(bias\\+\\)GELU kernel"):
        kernels.KERNELS["bias_gelu"][1]["liger"]()
