"""Tensor parallelism combined with ZeRO-1/2 and dropout, through train.py (gloo CPU ranks, fp32), against --mode
single with the same global batch (4 sequences of 32 tokens). ZeRO-3 + TP + SP with its resume, and DDP + TP + SP
with gradient accumulation, are runs of tests/integration/test_tp_training.py.

Runs (10 steps each, tests/train_runs.REFERENCE_ARGS; the others' flags in the tests), compared with the session's
single reference (batch 4, tests/conftest.py):
    zero1-tp2dp2-sp   --mode hybrid --zero-stage 1 --tp-size 2 --sequence-parallel on 4 ranks, batch 2
    zero2-tp2dp2      --mode hybrid --zero-stage 2 --tp-size 2 on 4 ranks, batch 2
    dropout-tp2[-sp]  --mode baseline --tp-size 2 --dropout 0.1 on 2 ranks, batch 4, with / without SP
The ZeRO runs take 4 ranks (TP 2 x DP 2): with DP 1, ZeRO partitions nothing over the data-parallel group.
lr 3e-3 on 8 repeated synthetic blocks: the loss falls (10.84 -> 9.44) and the gradient clip (1.0) is active.

Dropout: every rank draws from one torch RNG stream (build_model seeds all ranks alike), so a region that is
replicated over TP (embedding and residual dropout without SP) gets the same mask on both TP ranks, and the
replicated parameters (wpe, LayerNorms, row-parallel biases), whose gradients are not summed over TP without SP,
stay bit-identical. The losses do not match single's by design (parallel/__init__.py): each TP rank draws its
attention-dropout mask for [B, H/tp, T, T] where single draws [B, H, T, T], so those masks and every later draw
differ (TP vs single, both --dropout 0.1: 1e-3 to 2e-2 apart per step). Under --sequence-parallel the replicated
gradients are summed over TP, so that variant pins the sum (it stays identical even with per-rank dropout
seeds, and fails without the all-reduce); the variant without SP pins the shared RNG stream.

Tolerances (measured on CPU in brackets): per-step loss vs single <= 1e-5 relative, as in test_tp_training
[<= 3.9e-7]; pre-clip gradient norm vs single <= 1e-3 relative, as there [ZeRO <= 2.5e-4]; replicated tensors
across TP ranks with dropout: bit-identical [identical]; final loss with dropout vs single's without > 1e-2
[8.1e-2, 8.6e-2].
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt2.engines.base import state_file
from parallel.tp_plan import param_shard
from tests.train_runs import (
    REFERENCE_ARGS,
    REFERENCE_STEPS,
    ReferenceRun,
    assert_matches_reference,
    run_train,
    step_losses,
)

pytestmark = pytest.mark.slow
TP2 = ["--tp-size", "2"]
GRAD_NORM_REL_TOL = 1e-3


@pytest.mark.parametrize(("name", "flags"), [
    pytest.param("zero1-tp2dp2-sp", ["--zero-stage", "1", "--sequence-parallel"], id="zero1-tp2dp2-sp"),
    pytest.param("zero2-tp2dp2", ["--zero-stage", "2"], id="zero2-tp2dp2"),
])
def test_zero1_zero2_with_tp_match_single(single_reference: ReferenceRun, tmp_path: Path, name: str,
                                          flags: list[str]) -> None:
    """ZeRO-1/2 partition each TP shard's optimizer state (and ZeRO-2 its gradients) over DP only, clip with the
    TP-aware norm (mpu), and with SP the hooks sum the replicated gradients over TP before ZeRO reduces them."""
    run_train(REFERENCE_ARGS + ["--mode", "hybrid", *TP2, "--batch-size", "2", "--run-name", name] + flags, tmp_path,
              nproc=4)
    assert_matches_reference(single_reference, tmp_path / name, GRAD_NORM_REL_TOL)


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_dropout_keeps_replicated_params_identical_across_tp_ranks(single_reference: ReferenceRun, tmp_path: Path,
                                                                   sp: bool) -> None:
    """With --dropout 0.1, after 10 steps both TP ranks' checkpoints hold bit-identical replicated tensors (and
    different shards of the sharded ones)."""
    sp_flag = ["--sequence-parallel"] if sp else []
    run_train(REFERENCE_ARGS + ["--mode", "baseline", *TP2, "--batch-size", "4", "--dropout", "0.1", "--run-name",
                                "dropout", "--save-dir", str(tmp_path / "ck")] + sp_flag, tmp_path, nproc=2)
    losses = step_losses(tmp_path / "dropout")
    assert len(losses) == REFERENCE_STEPS
    assert abs(losses[-1] - step_losses(single_reference.run_dir)[-1]) > 1e-2  # dropout is active
    assert "dropout masks repeat across TP ranks" in (tmp_path / "dropout" / "console.log").read_text()
    folder = tmp_path / "ck" / f"step-{REFERENCE_STEPS:06d}"
    rank0, rank1 = (torch.load(state_file(folder, "model", r, 2), weights_only=True) for r in range(2))
    assert rank0.keys() == rank1.keys()
    replicated = [k for k in rank0 if param_shard(k).dim is None]
    assert any(k.startswith("wpe.") for k in replicated) and any(k.endswith("c_proj.bias") for k in replicated)
    for key in replicated:
        assert torch.equal(rank0[key], rank1[key]), f"{key} differs across TP ranks"
    assert not torch.equal(rank0["blocks.0.mlp.c_fc.weight"], rank1["blocks.0.mlp.c_fc.weight"])  # two shards
