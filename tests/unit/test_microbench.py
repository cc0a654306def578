"""microbench runs on CPU with the tiny preset and its op chain reproduces the real Block."""

from __future__ import annotations

import csv

import pytest

from benchmarks import microbench

BLOCK_OPS = ["ln_1", "qkv_proj", "attention (sdpa)", "attn_out_proj", "attn_dropout", "ln_2 + residual add",
             "mlp_up_proj", "gelu", "mlp_down_proj", "mlp_dropout", "residual add"]


def test_microbench_cpu_smoke(tmp_path):
    csv_path = tmp_path / "mb.csv"
    rows = microbench.main(["--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16", "--iters", "2",
                            "--device", "cpu", "--detailed", "--out", str(tmp_path), "--export-csv", str(csv_path)])
    names = [r["op"] for r in rows]
    assert names[: len(BLOCK_OPS)] == BLOCK_OPS and names[len(BLOCK_OPS)] == "ln_f + lm_head + loss"
    block = [r for r in rows if r["op"] in BLOCK_OPS]
    assert sum(r["share_of_block_%"] for r in block) == pytest.approx(100, abs=1)
    assert sum(r["fwd_share_of_mlp_%"] for r in block if "fwd_share_of_mlp_%" in r) == pytest.approx(100, abs=1)
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in block)
    written = list(csv.DictReader(csv_path.open()))
    assert [r["op"] for r in written] == names and written[0]["model"] == "gpt2-tiny"
    assert (tmp_path / "microbench_trace.json").stat().st_size > 0
