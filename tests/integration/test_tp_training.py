"""Tensor parallelism through train.py (gloo CPU ranks, fp32) against --mode single with the same global batch.

Runs (global batch 4 sequences of 32 tokens everywhere), compared with the session's single reference (batch 4,
tests/conftest.py):
    ddp-tp2dp2-sp-accum  --mode baseline --tp-size 2 --sequence-parallel on 4 ranks, batch 1 x accum 2,
                   --activation-checkpointing: DDP's no_sync on the first micro-step, the sequence-parallel all-reduce
                   once after the last backward, on the accumulated gradient (reducing after each micro-step would
                   double-count the first)
    zero3-tp2dp2-sp  --mode hybrid (ZeRO-3) --tp-size 2 --sequence-parallel on 4 ranks, batch 1 x accum 2,
                   --no-tp-overlap, --activation-checkpointing, checkpoint at step 5 (a DeepSpeed checkpoint in TP
                   layout: one mp_rank per TP rank, each partitioned over DP), resumed
    tp2            --mode baseline --tp-size 2 on 2 ranks (dp 1), batch 2 x accum 2, --activation-checkpointing,
                   --eval-interval 1, checkpoint at step 5, resumed
    tp2-compile    --mode baseline --tp-size 2 --compile on 2 ranks (dp 1), batch 4 (compiled blocks; the
                   vocab-parallel head stays eager)
    zero3-tp2-sp-compile  --mode hybrid --tp-size 2 --sequence-parallel --compile on 2 ranks (dp 1): compiled
                   block forwards inside ZeRO-3's per-block (leaf-module) gather hooks

tests/train_runs.REFERENCE_ARGS: lr 3e-3 on 8 repeated synthetic blocks, so the loss falls (10.84 -> 9.44 in 10
steps) and the gradient clip (1.0) is active on most steps: a wrong gradient shows (without the sequence-parallel
all-reduce, step 2 is off by 1.7e-4 relative).

The eager runs' measured TP bytes per step (our TP layers count each collective's payload in the engine's `CommStats`:
the summary's `plan/measured_tp_payload_bytes/<collective>`) equal the planner's `plan/tp_payload_bytes/<collective>`
exactly. The runs cover the code paths that change the count: no SP with accumulation, activation checkpointing and
an evaluation every step (its forwards must not be counted: tp2); SP's overlapped backward with activation
checkpointing (ddp-tp2dp2-sp-accum); ZeRO-3 with SP and accumulation, the SP gradients summed by per-parameter hooks
in every micro-step's backward (zero3-tp2dp2-sp). ZeRO-3's data-parallel bytes (--comm-log) are checked in
tests/integration/test_zero.py, FSDP2's in tests/integration/test_fsdp2.py.

Tolerances (measured on CPU in brackets): per-step loss vs single <= 1e-5 relative [<= 3.9e-7]; pre-clip
gradient norm vs single <= 1e-3 relative [1.1e-5 at step 1, <= 2.5e-4 after: single's clip_grad_norm_ reduces
the 3.2M-element embedding gradient with an fp32 vector_norm that is ~1e-5 off on CPU, and TP's fp32 sum of
squares is off by about as much (step 1: fp64 1.5540834, single 1.554066, DDP+TP 1.554067); Adam amplifies such
differences on near-zero gradients]; resume vs uninterrupted <= 1e-6 absolute, loss and gradient norm
[identical]; consolidated TP weights vs single's after 10 steps <= 5e-4 absolute [1.3e-4, one element: at lr 3e-3
one Adam step on a near-zero gradient moves a weight by up to 6e-3]; exported HF logits vs our model on the same
weights 1e-5; --init-from first loss of TP=2 vs transformers on that batch <= 1e-5 [TODO].
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt2.config.schema import DataConfig
from gpt2.data.loader import build_data
from tests.train_runs import (
    REFERENCE_ARGS,
    REFERENCE_BATCH,
    ReferenceRun,
    assert_hf_export_matches,
    assert_matches_reference,
    assert_resume_exact,
    by_collective,
    run_train,
    step_losses,
    summary,
    train_error,
)

pytestmark = pytest.mark.slow
TP_RUNS = {  # run name -> (processes, flags)
    "ddp-tp2dp2-sp-accum": (4, ["--mode", "baseline", "--tp-size", "2", "--batch-size", "1", "--grad-accum", "2",
                                "--sequence-parallel", "--activation-checkpointing"]),
    "zero3-tp2dp2-sp": (4, ["--mode", "hybrid", "--tp-size", "2", "--batch-size", "1", "--grad-accum", "2",
                            "--sequence-parallel", "--no-tp-overlap", "--activation-checkpointing"]),
    "tp2": (2, ["--mode", "baseline", "--tp-size", "2", "--batch-size", "2", "--grad-accum", "2",
                "--activation-checkpointing", "--eval-interval", "1"]),
    "tp2-compile": (2, ["--mode", "baseline", "--tp-size", "2", "--batch-size", "4", "--compile"]),
    "zero3-tp2-sp-compile": (2, ["--mode", "hybrid", "--tp-size", "2", "--batch-size", "4", "--sequence-parallel",
                                 "--compile"]),
}
RESUMED = ("tp2", "zero3-tp2dp2-sp")  # checkpointed at step 5 and resumed from it
COUNTED = ("ddp-tp2dp2-sp-accum", "zero3-tp2dp2-sp", "tp2")  # eager: CommStats counts no collective inside a graph
GRAD_NORM_REL_TOL = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp")
    for name, (nproc, flags) in TP_RUNS.items():
        resumable = ["--save-interval", "5"] if name in RESUMED else []
        run_train(REFERENCE_ARGS + flags + resumable + ["--run-name", name, "--save-dir", str(root / f"ck-{name}")],
                  root, nproc=nproc)
    for name in RESUMED:
        nproc, flags = TP_RUNS[name]
        run_train(REFERENCE_ARGS + flags + ["--run-name", f"{name}-resumed",
                                            "--resume", str(root / f"ck-{name}" / "step-000005")], root, nproc=nproc)
    return root


@pytest.mark.parametrize("name", list(TP_RUNS))
def test_tp_matches_single(single_reference: ReferenceRun, runs: Path, name: str) -> None:
    assert_matches_reference(single_reference, runs / name, GRAD_NORM_REL_TOL)
    s = summary(runs / name)
    dp = s["world_size"] // 2
    assert (s["tp_size"], s["dp_size"]) == (2, dp)
    assert s["tokens_per_step"] == REFERENCE_BATCH * 32  # dp x batch x accum x seq: TP ranks share their batch


@pytest.mark.parametrize("name", COUNTED)
def test_tp_bytes_measured_equal_predicted(runs: Path, name: str) -> None:
    s = summary(runs / name)
    predicted = by_collective(s, "plan/tp_payload_bytes/")
    measured = by_collective(s, "plan/measured_tp_payload_bytes/")
    kinds = {"all_reduce", "all_gather", "reduce_scatter"} if "--sequence-parallel" in TP_RUNS[name][1] else {
        "all_reduce"}
    assert set(predicted) == kinds, predicted
    assert measured == predicted, (measured, predicted)
    assert s["plan/measured_tp_payload_bytes"] == s["plan/tp_payload_bytes"] > 0
    assert "plan/comm_note" not in s


@pytest.mark.parametrize("name", RESUMED)
def test_tp_resume_is_exact(runs: Path, name: str) -> None:
    assert_resume_exact(runs / name, runs / f"{name}-resumed", at=5)
    step5 = runs / f"ck-{name}" / "step-000005"
    if name == "tp2":  # DDP: one model and optimizer file per TP rank
        assert sorted(p.name for p in step5.glob("*-tp*.pt")) == [
            "model-tp00.pt", "model-tp01.pt", "optimizer-tp00.pt", "optimizer-tp01.pt"]
    else:  # DeepSpeed: one mp_rank per TP rank, each partitioned over DP
        assert sorted(p.name for p in (step5 / "zero").glob("*_optim_states.pt")) == [
            f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt" for dp in range(2) for tp in range(2)]


def test_resume_with_another_tp_size_names_both(runs: Path, tmp_path: Path, capsys) -> None:
    err = train_error(REFERENCE_ARGS + ["--batch-size", "4", "--resume", str(runs / "ck-tp2" / "step-000005")],
                      capsys, out_dir=tmp_path)
    assert "tp_size: checkpoint 2, this run 1" in err
    assert not any(tmp_path.iterdir())  # failed before a run folder was made


def test_tp_checkpoints_export_and_init(single_reference: ReferenceRun, runs: Path, tmp_path: Path) -> None:
    """TP checkpoints (DDP files per TP rank, ZeRO-3 files per mp rank) -> the single-device weights; the HF
    export gives transformers logits equal to our model's; --init-from it into TP=2 starts at transformers' loss."""

    from gpt2.train.export import consolidated_state_dict, export_hf

    _, single_sd = consolidated_state_dict(single_reference.checkpoint)
    for name in TP_RUNS:
        cfg, tp_sd = consolidated_state_dict(runs / f"ck-{name}" / "step-000010")
        assert set(tp_sd) == set(single_sd), name
        for key, tensor in single_sd.items():
            assert tp_sd[key].shape == tensor.shape, (name, key)
            assert torch.allclose(tp_sd[key], tensor, atol=5e-4, rtol=0), (name, key)

    export_hf(runs / "ck-zero3-tp2dp2-sp", tmp_path / "hf")  # the save dir: its latest checkpoint
    _, zero3_sd = consolidated_state_dict(runs / "ck-zero3-tp2dp2-sp" / "step-000010")
    _, hf = assert_hf_export_matches(cfg, zero3_sd, tmp_path / "hf")

    # --init-from the export into TP=2 (each rank cuts its shards from the HF weights): the first step's loss
    # is transformers' loss on the run's first batch
    run_train(REFERENCE_ARGS + ["--max-steps", "1", "--init-from", str(tmp_path / "hf"), "--batch-size", "4", "--mode",
                        "baseline", "--tp-size", "2", "--run-name", "init-tp2"], tmp_path, nproc=2)
    data = build_data(DataConfig(data="synthetic", max_samples=8, eval_batches=2), seq_len=32, batch_size=4,
                      model_vocab_size=cfg.vocab_size, dp_rank=0, dp_size=1, seed=3, is_main=True,
                      barrier=lambda: None)
    x, y = data.train.next_batch()  # [4, 32] each
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    (got,) = step_losses(tmp_path / "init-tp2")
    assert abs(got - want) <= 1e-5 and abs(got - step_losses(single_reference.run_dir)[0]) > 0.5  # trained weights
