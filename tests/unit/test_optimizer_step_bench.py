"""benchmarks.optimizer_step off the GPU: the shape of its output for gpt2-tiny on the CPU (no timing ratios), and
that its compiled flat-buffer variant computes torch's clipped, guarded AdamW."""

from __future__ import annotations

import csv

import pytest
import torch

from benchmarks import optimizer_step


def test_the_cpu_run_writes_a_row_per_variant_with_its_bound_and_tag(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    # the Triton rows: seconds a call in the interpreter; their kernels: tests/unit/test_triton_adamw.py
    variants = [v for v in optimizer_step.VARIANTS if v not in optimizer_step.TRITON]
    rows = optimizer_step.main(["--model", "gpt2-tiny", "--device", "cpu", "--iters", "1", "--warmup", "1",
                                "--no-compile", "--profile", "--variants", ",".join(variants), "--out", str(tmp_path)])
    timed = [v for v in variants if v not in ("compiled-flat+clip", "copy")]
    assert [r["variant"] for r in rows] == [*timed, "copy"]
    assert not [r for r in rows if r.get("error")]
    n = rows[0]["params"]
    assert n == sum(p.numel() for p in _tiny_params())  # the model's parameters, the tied weight once
    by_name = {r["variant"]: r for r in rows}
    assert by_name["engine"]["min_GB"] == round(36 * n / 1e9, 3)
    assert by_name["fused-flat"]["tensors"] == 2 and by_name["fused"]["tensors"] > 2  # two groups, flat
    assert all(r["ms"] > 0 and r["GB/s"] > 0 and r["x_adamw_bound"] > 0 for r in rows if r["variant"] != "copy")
    with open(tmp_path / "optimizer_step.csv") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows)
    assert {"variant", "ms", "wall_ms", "min_GB", "GB/s", "x_adamw_bound", "device", "torch", "date", "commit"} \
        <= set(written[0])
    report = (tmp_path / "optimizer_step.md").read_text()
    assert "| engine |" in report and "AdamW bound" in report and "copy bandwidth" in report
    profile = (tmp_path / "optimizer_step_profile.md").read_text()
    assert all(f"## {v}\n" in profile for v in timed)


def _tiny_params() -> list[torch.nn.Parameter]:
    from gpt2.config.schema import MODEL_PRESETS, ModelConfig
    from gpt2.model.gpt import GPT

    model = GPT(ModelConfig(**MODEL_PRESETS["gpt2-tiny"]))
    return list({id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("grad_value", [0.05, 10.0, float("nan")])
def test_the_flat_update_is_torchs_clipped_guarded_adamw(grad_value: float) -> None:
    """adamw_update (eager here; the benchmark compiles it) against torch's fused AdamW handed the same divisor and
    non-finite flag: three steps, the last with `grad_value` gradients (nan: skipped, nothing changes)."""
    from gpt2.engines.guard import clip_divisor, step_if_finite

    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(1000))
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    p, m, v, step = ref.detach().clone(), torch.zeros(1000), torch.zeros(1000), torch.zeros(())
    for i in range(3):
        g = torch.randn(1000) * 0.01 if i < 2 else torch.full((1000,), grad_value)
        norm = torch.linalg.vector_norm(g)
        divisor, skip = clip_divisor(norm, 1.0), ~torch.isfinite(norm)
        ref.grad = g.clone()
        step_if_finite(opt, norm, divisor)
        optimizer_step.adamw_update([p], [g.clone()], [m], [v], step, divisor, skip, 1e-2, 0.9, 0.95, 1e-8, 0.1)
        state = opt.state[ref]
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, state["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-6, atol=1e-12)
        assert step.item() == state["step"].item()
