"""End-to-end runs of train.py: every mode trains the same function, and runs leave complete records.

Tolerance: DDP vs single is compared at <= 1e-5 relative per step, loss and pre-clip gradient norm (fp32 on CPU;
only the order of the gradient reduction differs). Losses alone cannot see a gradient-scale error (AdamW is
nearly scale-invariant and clipping rescales): a DDP sum instead of a mean, or a missing 1/grad-accum, doubles
every gradient norm and fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpt2.config.cli import parse_args
from gpt2.engines.base import lr_at
from tests.train_runs import (
    REFERENCE_ARGS,
    SHARED_DATA,
    TINY_ARGS,
    ReferenceRun,
    assert_matches_reference,
    read_records,
    run_train,
    step_losses,
    summary,
)


def test_ddp_with_accumulation_matches_single(single_reference: ReferenceRun, tmp_path: Path) -> None:
    """2 ranks x batch 1 x accum 2 against the session's single reference (batch 4, tests/conftest.py)."""
    run_train(REFERENCE_ARGS + ["--mode", "baseline", "--batch-size", "1", "--grad-accum", "2", "--run-name", "ddp"],
              tmp_path, nproc=2)
    assert_matches_reference(single_reference, tmp_path / "ddp", grad_norm_rel_tol=1e-5)
    s = summary(tmp_path / "ddp")
    assert s["tokens_per_step"] == 2 * 1 * 2 * 32  # dp x micro-batch x accum x seq
    assert (s["world_size"], s["dp_size"], s["tp_size"]) == (2, 2, 1)


def test_run_folder_is_complete_and_never_reused(tmp_path: Path) -> None:
    args = TINY_ARGS + ["--data", "synthetic", "--max-steps", "4", "--batch-size", "2", "--run-name", "demo",
                        "--eval-interval", "2", "--eval-batches", "2"]
    proc = run_train(args, tmp_path)
    # the same run name again (a new folder), this time with an offline wandb run and a peak that makes MFU
    # reportable on CPU
    wandb = [a for a in args if a not in ("--wandb", "disabled")] + ["--wandb", "offline", "--peak-tflops", "1"]
    run_train(wandb, tmp_path)
    first, second = tmp_path / "demo", tmp_path / "demo-1"
    assert first.is_dir() and second.is_dir()
    assert json.loads((first / "config.json").read_text())["train"]["max_steps"] == 4
    s = summary(first)
    for key in ("tokens_per_s", "step_time_s", "mem/peak_allocated_gib", "final_loss", "final_accuracy",
                "val_loss", "val_perplexity", "flops_per_token"):
        assert s[key] is not None, key
    assert s["mfu"] is None  # CPU: no peak known and none given
    # the logged lr is the one that step's update used (0-based lr_at), not the next step's
    cfg = parse_args(args)
    logged = {r["step"]: r["lr"] for r in read_records(first) if r["type"] == "step" and "lr" in r}
    assert logged == pytest.approx({step: lr_at(step - 1, cfg.train) for step in range(1, 5)})
    assert "summary:" in (first / "console.log").read_text()
    assert "summary:" in proc.stderr
    assert list((second / "wandb").glob("offline-run-*")), "no offline wandb run folder"
    assert summary(second)["mfu"] is not None


@pytest.mark.skipif(not (SHARED_DATA / "wikitext-2").is_dir(), reason="../shared/data is absent")
def test_wikitext2_training_reduces_loss(tmp_path: Path) -> None:
    args = TINY_ARGS + ["--data-path", str(SHARED_DATA / "wikitext-2"), "--tokenizer",
                        str(SHARED_DATA / "gpt2-tokenizer" / "tokenizer.json"), "--cache-dir", str(tmp_path / "cache"),
                        "--max-steps", "30", "--batch-size", "8", "--lr", "3e-3", "--num-proc", "2",
                        "--run-name", "wt2", "--max-samples", "2000"]
    run_train(args, tmp_path, timeout=600)
    losses = step_losses(tmp_path / "wt2")
    assert losses[0] > 10.0 and losses[-1] < losses[0] - 2.0
    assert summary(tmp_path / "wt2")["val_perplexity"] < 5000


def _profiled_steps(run_dir: Path) -> list[int]:
    """The ProfilerStep numbers in the run's Chrome trace (torch numbers the steps it records from 0)."""
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    return sorted({int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#")})


@pytest.mark.parametrize("resume_from", [0, 5])
def test_profiled_steps_are_left_out_of_tokens_per_s(tmp_path: Path, resume_from: int) -> None:
    """--profile: the 3 recorded steps (after 1 warm-up step and the profiler's own warm-up step) are slower than the
    others, so tokens/s averages only the steps after them; the summary carries the profile's per-step figures. A
    resumed run profiles its own steps 3-5 too, the ones its tokens/s leaves out."""
    common = TINY_ARGS + ["--data", "synthetic", "--batch-size", "2", "--seed", "4"]
    resume = []
    if resume_from:
        run_train(common + ["--max-steps", str(resume_from), "--run-name", "first", "--save-dir",
                            str(tmp_path / "ck"), "--save-interval", str(resume_from)], tmp_path)
        resume = ["--resume", str(tmp_path / "ck" / f"step-{resume_from:06d}")]
    run_train(common + resume + ["--max-steps", str(resume_from + 8), "--run-name", "prof",
                                 "--throughput-warmup-steps", "1", "--profile"], tmp_path)
    s = summary(tmp_path / "prof")
    assert s["measured_steps"] == 3  # steps 6-8 of this run
    assert _profiled_steps(tmp_path / "prof") == [2, 3, 4]  # torch's numbering: the run's steps 3-5
    assert s["profile/step_wall_ms"] > 0 and s["profile/kernels_per_step"] == 0  # CPU: no kernels
    assert s["profile/device_busy_pct"] is None
    assert json.loads((tmp_path / "prof" / "profile_breakdown.json").read_text())["steps"] == 3
