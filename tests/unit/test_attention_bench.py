"""benchmarks.attention_backends runs end to end on CPU at a tiny shape (the math and CPU flash kernels; the
CUDA-only ones and a missing flash-attn are rows with their error), so the GPU script cannot rot."""

from __future__ import annotations

import csv
import importlib.util

from benchmarks import attention_backends


def test_attention_backends_cpu(tmp_path, capsys):
    attention_backends.main(["--device", "cpu", "--batch-sizes", "1,2", "--heads", "2", "--seq-len", "40",
                             "--head-dim", "16", "--dtype", "fp32", "--backends", "math,flash,cudnn,flash-attn",
                             "--iters", "2", "--out", str(tmp_path)])
    with (tmp_path / "attention_backends.csv").open() as f:
        rows = {(r["B"], r["backend"]): r for r in csv.DictReader(f)}
    assert len(rows) == 8
    for B in ("1", "2"):
        for name in ("math", "flash"):
            r = rows[B, name]
            assert not r["error"] and float(r["fwd_ms"]) > 0 and float(r["fwdbwd_ms"]) > 0, r
            assert float(r["err_out"]) < 1e-5 and float(r["err_grad"]) < 1e-5, r
        assert float(rows[B, "math"]["err_out"]) == 0.0  # the reference itself
        assert min(float(rows[B, n]["vs_fastest"]) for n in ("math", "flash")) == 1.0
        assert rows[B, "cudnn"]["error"].startswith("RuntimeError")
        if importlib.util.find_spec("flash_attn") is None:
            assert "flash-attn package" in rows[B, "flash-attn"]["error"]
    md = (tmp_path / "attention_backends.md").read_text()
    assert "| 2 | 2 | 40 | 16 | fp32 | math |" in md
    assert "- [1, 2, 40, 16] fp32: `--attn sdpa` runs" in md and "`--attn auto -> sdpa`" in md
