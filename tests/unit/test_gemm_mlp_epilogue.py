"""The MLP up-projection's fused forward (bias + GELU + pre-activation) and backward (GELU' + bias gradient) GEMM
epilogues: on CPU, the fp64 reference the bench checks against and its PASS/FAIL logic (run end to end with torch
stand-ins for the kernels); on a Hopper GPU, the kernels match the reference (the nvcc build check of all four
instantiations is tests/unit/test_gemm_build.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.gemm import bench
from fused_kernels.cuda.mlp import hopper


def test_gelu_tanh_grad_matches_autograd():
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(F.gelu(x, approximate="tanh").sum(), x)
    assert torch.allclose(bench.gelu_tanh_grad(x.detach()), grad, rtol=1e-12, atol=1e-12)
    ours = torch.ops.aten.gelu_backward(torch.ones_like(x), x.detach(), approximate="tanh")  # what eager runs
    assert torch.allclose(ours, grad, rtol=1e-12, atol=1e-12)


def test_over_tolerance_names_nan_and_errors_above_tolerance():
    assert bench.over_tolerance({"a": 0.0, "b": bench.TOLERANCE}) == []
    assert bench.over_tolerance({"a": 0.0, "b": 2 * bench.TOLERANCE}) == ["b"]
    assert bench.over_tolerance({"a": float("nan")}) == ["a"]


def torch_fused(wrong: str | None = None) -> dict[str, bench.Gemm]:
    """Stand-ins for the two fused kernels with their bindings' signatures; `wrong` breaks one output."""

    def bias_gelu_aux(A, B, bias, C, AUX):
        pre = A.double() @ B.double() + bias.double()
        AUX.copy_(pre if wrong != "pre" else pre + 1)
        C.copy_(bench.gelu_tanh(pre))

    def dgelu(A, B, AUX, C, DBIAS):
        dpre = (A.double() @ B.double()) * bench.gelu_tanh_grad(AUX.double())
        C.copy_(dpre if wrong != "dpre" else dpre * 0.9)
        if wrong != "db_unwritten":
            DBIAS.add_(dpre.sum(0) if wrong != "db" else dpre[1:].sum(0))  # "db": a row left out

    return {"wgmma_persistent_bias_gelu_aux": bias_gelu_aux, "wgmma_persistent_dgelu": dgelu}


def run_bench(monkeypatch, ext) -> list[dict[str, object]]:
    times = iter([1.0, 2.0, 1.0, 2.0, 0.5, 1.0])  # fwd, bwd of each variant in order: fused is 2x faster
    monkeypatch.setattr(bench, "timed_call_ms", lambda call, budget_s: (call(), next(times))[1])
    return bench.mlp_up_fwd_bwd_bench(ext, budget_s=0.0, tokens=64, d=32, device="cpu")


def test_mlp_fwd_bwd_bench_passes_correct_outputs(monkeypatch):
    rows = run_bench(monkeypatch, torch_fused())
    assert [r["status"] for r in rows] == ["PASS"] * 3, rows
    for r in rows:
        assert all(float(r[f"rel_err_{k}"]) <= bench.TOLERANCE for k in ("h", "pre", "dpre", "db"))
    assert rows[-1]["variant"].startswith("fused") and rows[-1]["total_ms"] == 1.5
    assert rows[-1]["speedup_vs_best_separate"] == 2.0
    assert "2.0" in bench.mlp_fwd_bwd_section(rows)


@pytest.mark.parametrize("wrong", ["pre", "dpre", "db", "db_unwritten"])
def test_mlp_fwd_bwd_bench_fails_a_wrong_output(monkeypatch, wrong):
    rows = run_bench(monkeypatch, torch_fused(wrong))
    fused = rows[-1]
    assert fused["status"].startswith("FAIL"), fused
    assert wrong.split("_")[0] in fused["status"], fused  # names the bad output
    assert not {"fwd_ms", "bwd_ms", "total_ms", "speedup_vs_best_separate"} & set(fused)  # never timed
    assert [r["status"] for r in rows[:2]] == ["PASS", "PASS"]


def test_mlp_fwd_bwd_bench_without_the_kernels_runs_separate_only(monkeypatch):
    rows = run_bench(monkeypatch, {})
    assert [r["variant"].split(":")[0] for r in rows] == ["separate", "separate"]


HOPPER = hopper()


@pytest.fixture(scope="module")
def hopper_ext():
    return bench.build_extension(kernels=bench.HOPPER_KERNELS)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("M,N,K", [(8192, 5120, 1280), (1950, 1288, 72), (100, 8, 8), (2000, 4104, 328)])
def test_fused_mlp_epilogues_match_fp64(hopper_ext, M, N, K):
    """Off-tile shapes too: rows >= M and columns >= N must neither be written nor reach DBIAS."""
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    A = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    B = (torch.randn(K, N, device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
    bias = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
    C, AUX = (torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    hopper_ext["wgmma_persistent_bias_gelu_aux"](A, B, bias, C, AUX)
    pre = A.double() @ B.double() + bias.double()
    assert bench.relative_error(AUX, pre) <= 1e-2
    assert bench.relative_error(C, bench.gelu_tanh(pre)) <= 1e-2

    dC = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    dbias = torch.zeros(N, device="cuda", dtype=torch.float32)
    hopper_ext["wgmma_persistent_dgelu"](A, B, AUX, dC, dbias)
    dpre = (A.double() @ B.double()) * bench.gelu_tanh_grad(AUX.double())
    assert bench.relative_error(dC, dpre) <= 1e-2
    assert bench.relative_error(dbias, dpre.sum(0)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
def test_dgelu_rejects_a_bf16_dbias(hopper_ext):
    A = torch.zeros(128, 64, device="cuda", dtype=torch.bfloat16)
    B = torch.zeros(64, 256, device="cuda", dtype=torch.bfloat16)
    C, AUX = (torch.empty(128, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(RuntimeError, match="DBIAS must be"):
        hopper_ext["wgmma_persistent_dgelu"](A, B, AUX, C, torch.zeros(256, device="cuda", dtype=torch.bfloat16))
