"""tools.report on synthetic run folders: the table's values, the planner table, the PNGs, folder handling."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image

from tools.report import PLOTS, find_runs, load_run, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(root: Path, name: str, summary: dict, steps: list[dict], parallel: dict | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    lines = [json.dumps({"type": "step", **s}) for s in steps] + [json.dumps({"type": "summary", **summary})]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "config.json").write_text(json.dumps({"parallel": parallel or {"zero_stage": 3,
                                                                           "sequence_parallel": False}}))
    return run


def summary(mode: str, **kw) -> dict:
    return {"mode": mode, "model": "gpt2-large", "world_size": 4, "tp_size": 1, "batch_size_per_gpu": 8,
            "seq_len": 1024, "precision": "bf16", "device": "NVIDIA H200", "torch_version": "2.11",
            "peak_tflops_per_gpu": 989.0, "fused_kernels": "none", **kw}


def make_runs(root: Path) -> list[Path]:
    ddp = write_run(root, "ddp-b8", summary(
        "baseline", tokens_per_s=123456.7, mfu=0.4567, **{"mem/peak_allocated_gib": 26.76}, train_time_s=95.25,
        final_loss=6.54321, final_accuracy=0.12345, val_loss=6.6,
        **{"plan/peak_gib": 26.5, "plan/measured_peak_gib": 26.76, "plan/peak_error": -0.0097}), [
        {"step": 1, "loss": 11.0, "mem/peak_allocated_gib": 25.0},
        {"step": 5, "loss": 8.0, "mem/peak_allocated_gib": 26.7},
        {"step": 5, "loss": 7.5, "mem/peak_allocated_gib": 26.76},  # logged again after a resume: the latest wins
        {"step": 5, "val_loss": 6.6},  # eval record: not a training step
    ])
    tp = write_run(root, "zero3-tp2-b8", summary(
        "hybrid", tp_size=2, fused_kernels="triton", tokens_per_s=None, mfu=None,
        **{"mem/peak_allocated_gib": 12.5}, train_time_s=80.0, final_loss=6.7, final_accuracy=0.11), [
        {"step": 1, "loss": 11.0, "mem/peak_allocated_gib": 12.0}], parallel={"zero_stage": 3,
                                                                              "sequence_parallel": True})
    (root / "crashed").mkdir()
    (root / "crashed" / "metrics.jsonl").write_text(json.dumps({"type": "step", "step": 1, "loss": 11.0}) + "\n")
    return [ddp, tp]


def test_report_table_and_plots(tmp_path, capsys):
    ddp, tp = make_runs(tmp_path / "runs")
    out = tmp_path / "report"
    assert main([str(ddp), str(tp), str(tmp_path / "runs" / "crashed"), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    rows = [line for line in text.splitlines() if line.startswith("| ddp") or line.startswith("| zero3")]
    assert rows[0] == "| ddp | ddp-b8 | 4 | 8 | 123,457 | 45.7% | 26.76 | 95.2 | 6.5432 | 0.1235 | 6.6000 |"
    assert rows[1] == ("| zero3-tp2-sp triton | zero3-tp2-b8 | 4 | 8 | n/a | n/a | 12.50 | 80.0 | 6.7000 | 0.1100 "
                       "| n/a |")
    # planner table: only the run that carries plan/* keys
    assert rows[2] == "| ddp | 8 | 26.50 | 26.76 | -1.0% | n/a | n/a |"
    assert len(rows) == 3
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 200
        assert image[..., :3].std() > 0.01  # something was drawn


def test_runs_found_in_parent_folder_and_steps_deduplicated(tmp_path):
    make_runs(tmp_path / "runs")
    found = find_runs([str(tmp_path / "runs")])
    assert [p.name for p in found] == ["crashed", "ddp-b8", "zero3-tp2-b8"]
    assert load_run(found[0]) is None  # no summary record
    ddp = load_run(found[1])
    assert [(s["step"], s["loss"]) for s in ddp.steps] == [(1, 11.0), (5, 7.5)]
    assert ddp.name == "ddp b8"


def test_no_runs(tmp_path):
    assert main([str(tmp_path), "--out", str(tmp_path / "r")]) == 1


def test_a_damaged_run_folder_is_skipped_and_named(tmp_path, capsys):
    """One run killed mid-write (a cut last line) or a damaged summary must not stop the report of the others."""
    make_runs(tmp_path / "runs")
    cut = tmp_path / "runs" / "zero3-tp2-b8" / "metrics.jsonl"
    cut.write_text(cut.read_text()[:-20])
    (tmp_path / "runs" / "other").mkdir()
    (tmp_path / "runs" / "other" / "summary.json").write_text('{"mode": "single"}')
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert f"skipped {cut.parent}: {cut} line " in err and "is not valid JSON" in err and "truncated or damaged" in err
    assert f"skipped {tmp_path / 'runs' / 'other'}: its summary lacks world_size, batch_size_per_gpu" in err
    assert "| ddp |" in (tmp_path / "out" / "report.md").read_text()


def test_a_path_that_gives_no_run_folder_is_named(tmp_path, capsys):
    make_runs(tmp_path / "runs")
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "runs" / "ddp-b8"), str(tmp_path / "typo"), str(tmp_path / "empty"), "--out",
                 str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert f"skipped {tmp_path / 'typo'}: no such folder" in err
    assert f"skipped {tmp_path / 'empty'}: no run folder in it" in err


def test_report_checks_out_and_lists_a_run_once(tmp_path, capsys):
    """--out a file: argparse's one line before any run is read (was a traceback at the end); a run named twice
    (and through its parent folder) is one row, and the Run column tells apart runs of one configuration."""
    import pytest

    ddp, _ = make_runs(tmp_path / "runs")
    (tmp_path / "file").write_text("a user's file")
    with pytest.raises(SystemExit) as refused:
        main([str(ddp), "--out", str(tmp_path / "file")])
    assert refused.value.code == 2 and "--out " in capsys.readouterr().err
    again = write_run(tmp_path / "more", "ddp-b8-2", summary("baseline"), [{"step": 1, "loss": 11.0}])
    assert main([str(ddp), str(ddp), str(tmp_path / "runs"), str(again), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert text.count("| ddp | ddp-b8 |") == 1 and text.count("| ddp | ddp-b8-2 |") == 1, text
