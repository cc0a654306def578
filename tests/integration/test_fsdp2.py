"""`--mode hybrid --zero-engine fsdp2` (PyTorch FSDP2, gpt2.engines.fsdp2_engine) through train.py on gloo CPU ranks,
fp32, against the session's --mode single reference (tests/conftest.py: batch 4, lr 3e-3, the clip at 1.0 active on
most steps, so a wrong gradient norm changes the updates).

Runs (10 steps each; the same global batch of 4 sequences):
    fsdp2            2 ranks, batch 1 x accum 2 (set_requires_gradient_sync off on the first micro-step),
                     --fsdp2-params tensors (each parameter its own FSDP2 tensor; the others run the default, each
                     unit's flat tensors), --fsdp2-unit-blocks 1, --activation-checkpointing (each block recomputed
                     in backward, its FSDP2 gather inside the recomputed call), checkpoints at steps 5 and 10,
                     --comm-log; fsdp2-resumed from step 5 at --fsdp2-unit-blocks 2 (one launch checks both that the
                     resume is exact and that a checkpoint of ungrouped blocks resumes into BlockUnits, each block
                     checkpointed inside its unit: the engine saves and loads under the blocks' own names)
    ds-launcher      --zero-stage 2 (reshard_after_forward=False) under the deepspeed launcher, 2 ranks, batch 1 x
                     accum 2, --activation-checkpointing (each flat unit recomputed whole), --comm-log, an evaluation
                     mid-run
    fsdp2-tp2dp2-sp  --tp-size 2 --sequence-parallel on 4 ranks (DP groups [0, 2] and [1, 3]), batch 2, checkpoint
                     at step 5 (flat tensors and their layout); resumed from it
    tp-compile       --tp-size 2 --compile --activation-checkpointing (each flat unit's forward compiled and
                     checkpointed whole, FSDP2's hooks eager) on 4 ranks, batch 2,
                     --comm-log, an evaluation mid-run (the plain blocks' compiled graph is ZeRO-3's in
                     tests/integration/test_zero.py: one launch fewer here)
Tolerances (measured on CPU, torch 2.13, in brackets): per-step loss vs single <= 1e-5 relative
(tests/train_runs.LOSS_REL_TOL) [2.0e-7 on 2 ranks, 2.9e-7 with TP], pre-clip gradient norm (the global norm the clip
uses: DTensor gradients reduced over DP, TP shards over TP) <= 2e-4 relative at tp 1, as the DeepSpeed tests
[6.4e-5], <= 1e-3 with TP, as test_tp_modes [1.5e-4]; first-step loss within 1e-5 of single's (the same initial
weights); resume vs uninterrupted <= 1e-6 absolute [identical]; exported weights vs single's after 10 steps
<= 1e-4 at tp 1, as DeepSpeed's [8.8e-6], <= 5e-4 with TP [1.2e-4; lr 3e-3: Adam turns the TP reduction order's
noise into more drift; the step-5 weights are 5.2e-3 away]; --comm-log bytes = the planner's [equal].
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.train_runs import (
    REFERENCE_ARGS,
    ReferenceRun,
    assert_hf_export_matches,
    assert_matches_reference,
    assert_resume_exact,
    assert_weights_match,
    first_batch_loss,
    run_train,
    step_losses,
    summary,
)

pytestmark = pytest.mark.slow
FSDP2 = REFERENCE_ARGS + ["--mode", "hybrid", "--zero-engine", "fsdp2"]
GRAD_NORM_REL_TOL = 2e-4  # tp 1, as tests/integration/test_zero.py
TP_GRAD_NORM_REL_TOL = 1e-3  # with TP, as tests/integration/test_tp_modes.py


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """FSDP2 over its own tensors with accumulation, activation checkpointing and checkpoints, one block a unit (the
    other tests run the default unit, both blocks of the reference model, over flat tensors), and its resume from step
    5 at two blocks a unit (the regrouped resume: test_fsdp2_checkpoint_resumes_at_another_unit_size)."""
    root = tmp_path_factory.mktemp("fsdp2")
    args = FSDP2 + ["--batch-size", "1", "--grad-accum", "2", "--activation-checkpointing", "--fsdp2-params", "tensors"]
    run_train(args + ["--fsdp2-unit-blocks", "1", "--run-name", "fsdp2", "--save-dir", str(root / "ck"),
                      "--save-interval", "5", "--comm-log"], root, nproc=2)
    run_train(args + ["--fsdp2-unit-blocks", "2", "--run-name", "fsdp2-resumed", "--resume",
                      str(root / "ck" / "step-000005")], root, nproc=2)
    return root


def test_fsdp2_matches_single(single_reference: ReferenceRun, runs: Path) -> None:
    assert_matches_reference(single_reference, runs / "fsdp2", GRAD_NORM_REL_TOL)
    first = step_losses(runs / "fsdp2")[0]
    assert abs(first - step_losses(single_reference.run_dir)[0]) < 1e-5 and abs(first - math.log(50257)) < 0.1
    s = summary(runs / "fsdp2")
    assert (s["mode"], s["zero_engine"], s["world_size"], s["dp_size"], s["grad_accum"], s["fsdp2_unit_blocks"],
            s["compile_wrapper"]) == ("hybrid", "fsdp2", 2, 2, 2, 1, None)
    assert s["val_loss"] is not None
    assert_comm_log_is_the_plan(s)
    console = (runs / "fsdp2" / "console.log").read_text()
    assert "FSDP2: 3 units (transformer blocks in units of at most 1, + embeddings/head) sharded over the " \
           "data-parallel group of 2" in console
    assert "reshard_after_forward=True: ZeRO-3" in console


def assert_comm_log_is_the_plan(s: dict) -> None:
    """--comm-log's measured all-gather and reduce-scatter bytes per step equal the planner's FSDP2 prediction (the
    root unit gathered once a micro-step, each block twice at stage 3, the gradients reduce-scattered once a step)."""
    for kind in ("all_gather", "reduce_scatter"):
        assert s[f"plan/measured_dp_payload_bytes/{kind}"] == s[f"plan/dp_payload_bytes/{kind}"] > 0, kind


def test_fsdp2_resume_is_exact(runs: Path) -> None:
    step5 = runs / "ck" / "step-000005"
    assert sorted(p.name for p in (step5 / "fsdp2").iterdir()) == ["schedule.pt", "tp00"]
    assert sorted(p.name for p in (step5 / "fsdp2" / "tp00").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert_resume_exact(runs / "fsdp2", runs / "fsdp2-resumed", at=5)


def test_fsdp2_checkpoint_resumes_at_another_unit_size(runs: Path) -> None:
    """Under --fsdp2-params tensors, --fsdp2-unit-blocks changes how blocks are grouped, not the checkpoint's names or
    shards: a checkpoint saved at one block a unit (no BlockUnits, as every checkpoint before units were modules)
    resumes at two (the fixture's fsdp2-resumed, whose exactness test_fsdp2_resume_is_exact checks)."""
    s = summary(runs / "fsdp2-resumed")
    assert (s["fsdp2_unit_blocks"], summary(runs / "fsdp2")["fsdp2_unit_blocks"]) == (2, 1)
    assert "FSDP2: 2 units (transformer blocks in units of at most 2, + embeddings/head)" in (
        runs / "fsdp2-resumed" / "console.log").read_text()


def test_fsdp2_checkpoint_exports_and_inits(single_reference: ReferenceRun, runs: Path, tmp_path: Path) -> None:
    """DCP shards -> one fp32 state dict on the CPU (no process group) -> an HF folder whose logits equal our model's,
    and which --init-from loads under FSDP2 as under single."""
    from gpt2.train.export import export_hf

    cfg, fsdp2_sd = assert_weights_match(runs / "ck" / "step-000010", single_reference.checkpoint, atol=1e-4)
    export_hf(runs / "ck", tmp_path / "hf")  # the save dir: its latest checkpoint
    ours, _ = assert_hf_export_matches(cfg, fsdp2_sd, tmp_path / "hf")

    # --init-from under FSDP2: its first loss is the exported model's on that batch (single's --init-from:
    # tests/integration/test_checkpoint.py)
    args = REFERENCE_ARGS + ["--max-steps", "1", "--init-from", str(tmp_path / "hf")]
    run_train(args + ["--mode", "hybrid", "--zero-engine", "fsdp2", "--batch-size", "2", "--run-name", "init-fsdp2"],
              tmp_path, nproc=2)
    a, (b,) = first_batch_loss(ours, REFERENCE_ARGS + ["--batch-size", "4"]), step_losses(tmp_path / "init-fsdp2")
    assert abs(a - b) <= 1e-5 and abs(a - step_losses(single_reference.run_dir)[0]) > 1e-3  # trained weights


def test_fsdp2_checkpoint_does_not_resume_under_deepspeed(runs: Path) -> None:
    """The engines' checkpoints differ (DCP folders vs DeepSpeed's): the other engine is refused, naming both (the
    start-up check train.py runs on every rank, here for this checkpoint's 2 ranks: no launch needed)."""
    from gpt2.config.cli import parse_args
    from gpt2.config.layout import RunLayout
    from gpt2.train.checkpoint import CheckpointError, check_compatible, read_meta

    step5 = runs / "ck" / "step-000005"
    cfg = parse_args(REFERENCE_ARGS + ["--mode", "hybrid", "--batch-size", "1", "--grad-accum", "2"])
    wrong = re.escape("zero_engine: checkpoint 'fsdp2', this run 'deepspeed' (--zero-engine)")
    with pytest.raises(CheckpointError, match=wrong):
        check_compatible(read_meta(step5), RunLayout.resolve(cfg, 2, "cpu"), step5)


def assert_default_units(run_dir: Path, reshard: str) -> dict:
    """A run at the default unit size (both blocks of the reference model in one unit): its console names the units
    and the reshard mode; returns its summary."""
    s = summary(run_dir)
    assert s["fsdp2_unit_blocks"] == 2 and s["fsdp2_gather"] == "fp32"  # CPU runs are fp32
    console = (run_dir / "console.log").read_text()
    assert reshard in console
    assert "FSDP2: 2 units (transformer blocks in units of at most 2, + embeddings/head)" in console
    return s


def test_fsdp2_zero2_under_the_deepspeed_launcher_matches_single(single_reference: ReferenceRun,
                                                                 tmp_path: Path) -> None:
    """`deepspeed --num_gpus 2 train.py --mode hybrid --zero-engine fsdp2` (the launcher users start hybrid runs with;
    CPU ranks under DS_ACCELERATOR=cpu) trains single's function as under torchrun, here at --zero-stage 2 over flat
    unit tensors (the default) with accumulation and each unit checkpointed whole; an evaluation mid-run (its
    forwards leave the units that are not resharded after forward gathered, until the engine reshards them) changes
    nothing the run trains."""
    from tests.train_runs import ROOT, train_env
    from tools.common import free_port

    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    proc = subprocess.run([*launcher, str(ROOT / "train.py"), *FSDP2, "--batch-size", "1", "--grad-accum", "2",
                           "--activation-checkpointing", "--zero-stage", "2",
                           "--comm-log", "--eval-interval", "5", "--run-name", "ds-launcher", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, env=train_env(), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_matches_reference(single_reference, tmp_path / "ds-launcher", GRAD_NORM_REL_TOL)
    s = assert_default_units(tmp_path / "ds-launcher", "reshard_after_forward=False: ZeRO-2")
    assert (s["world_size"], s["compile_wrapper"]) == (2, None)
    assert_comm_log_is_the_plan(s)


def test_fsdp2_tp_sp_matches_single_resumes_and_exports(single_reference: ReferenceRun, tmp_path: Path) -> None:
    """TP 2 x DP 2: our TP shards in flat unit tensors (their TP and SP marks and weight-decay answer carried through
    fully_shard), FSDP2-sharded over the strided DP groups; the TP-aware global norm, the sequence-parallel sum over
    TP after the reduce-scatter, one DCP folder per TP rank and the flat tensors' layout; a resume of other tensors
    or units refused, naming the flag; and the export splitting the flat tensors and joining the TP shards."""
    from gpt2.config.cli import parse_args
    from gpt2.config.layout import RunLayout
    from gpt2.runtime.flat_blocks import FLAT_LAYOUT_FILE
    from gpt2.train.checkpoint import CheckpointError, check_compatible, read_meta

    args = FSDP2 + ["--tp-size", "2", "--sequence-parallel", "--batch-size", "2"]
    ck = tmp_path / "ck"
    run_train(args + ["--run-name", "full", "--save-dir", str(ck), "--save-interval", "5"], tmp_path, nproc=4)
    step5 = ck / "step-000005"
    assert sorted(p.name for p in (step5 / "fsdp2").iterdir()) == ["schedule.pt", "tp00", "tp01"]
    assert (step5 / FLAT_LAYOUT_FILE).is_file()
    run_train(args + ["--run-name", "resumed", "--resume", str(step5)], tmp_path, nproc=4)
    assert_matches_reference(single_reference, tmp_path / "full", TP_GRAD_NORM_REL_TOL)
    assert_resume_exact(tmp_path / "full", tmp_path / "resumed", at=5)
    assert summary(tmp_path / "full")["fsdp2_params"] == "flat"
    assert ("FSDP2 flat parameters: 4 tensors a unit of 2 transformer blocks (other.no_decay_sp, matmul.decay_tp, "
            "matmul.no_decay_tp, matmul.no_decay_sp)") in (tmp_path / "full" / "console.log").read_text()
    meta = read_meta(step5)
    assert (meta["fsdp2_params"], meta["fsdp2_unit_blocks"]) == ("flat", 2)
    for other, wrong in ((["--fsdp2-params", "tensors"], "fsdp2_params: checkpoint 'flat', this run 'tensors' ("
                          "--fsdp2-params flat keeps each unit's parameters in flat tensors; resume it with "
                          "--fsdp2-params flat --fsdp2-unit-blocks 2)"),
                         (["--fsdp2-unit-blocks", "1"], "fsdp2_unit_blocks: checkpoint 2, this run 1")):
        with pytest.raises(CheckpointError, match=re.escape(wrong)):
            check_compatible(meta, RunLayout.resolve(parse_args([*args, *other]), 4, "cpu"), step5)
    # lr 3e-3: Adam turns the TP reduction order's noise into more drift than at tp 1
    assert_weights_match(ck / "step-000010", single_reference.checkpoint, atol=5e-4)


def test_fsdp2_tp_compile_matches_single(single_reference: ReferenceRun, tmp_path: Path) -> None:
    """The parity row fsdp2-tp2-compile-wW on CPU, with --activation-checkpointing: TP 2 x DP 2 with each unit's
    forward compiled over its flat tensors (FSDP2's hooks eager) and checkpointed whole, an evaluation mid-run;
    --comm-log's bytes are the plan's under compile too."""
    run_train(FSDP2 + ["--tp-size", "2", "--compile", "--activation-checkpointing", "--batch-size", "2", "--comm-log",
                       "--eval-interval", "5", "--run-name", "tp-compile"], tmp_path, nproc=4)
    assert_matches_reference(single_reference, tmp_path / "tp-compile", TP_GRAD_NORM_REL_TOL)
    s = assert_default_units(tmp_path / "tp-compile", "reshard_after_forward=True: ZeRO-3")
    assert (s["tp_size"], s["dp_size"], s["compile_wrapper"], s["fsdp2_params"]) == (2, 2, "python", "flat")
    assert_comm_log_is_the_plan(s)


CLIP = 0.05  # below this model's gradient norm (asserted): the clip scales every gradient


def run_fsdp2_clip_checks(dims) -> None:
    """On each rank of TP 2 x DP 2: one backward of the FSDP2-sharded TP model (sequence-parallel), clipped by
    `parallel.grads.clip_grad_norm_` over its DTensor gradients, against the single-device model on the mean loss of
    both DP replicas' batches, clipped by torch: the same global norm, and the same clipped gradients once the DP
    shards (full_tensor) and the TP shards (the plan) are joined."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from gpt2.engines.fsdp2_engine import shard_model
    from parallel.grads import allreduce_sequence_parallel_grads, clip_grad_norm_
    from tests.unit.test_tp_model import batch, build, full_grads

    ref = build()
    losses = [ref(*batch(r))[0] for r in range(dims.dp_size)]
    (sum(losses) / dims.dp_size).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    assert ref_norm > 4 * CLIP

    model = build(dims, sequence_parallel=True, overlap=False)
    shard_model(model, DeviceMesh.from_group(dims.dp_group, "cpu"), reshard_after_forward=True)
    model(*batch(dims.dp_rank))[0].backward()
    allreduce_sequence_parallel_grads(model, dims)
    norm = clip_grad_norm_(list(model.parameters()), CLIP, dims)
    assert not isinstance(norm, DTensor) and abs(norm.item() - ref_norm.item()) <= 1e-5 * ref_norm
    gathered = SimpleNamespace(named_parameters=lambda: [  # this TP rank's shards, gathered over DP, for full_grads
        (name, SimpleNamespace(grad=p.grad.full_tensor())) for name, p in model.named_parameters()])
    clipped = full_grads(gathered, dims)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(clipped[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_fsdp2_tp_clipping_uses_the_global_norm() -> None:
    from tests._tp_harness import spawn

    spawn(run_fsdp2_clip_checks, 4, 2)
