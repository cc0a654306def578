"""Measured communication bytes per training step (train.py summary) against the planner's prediction.

TP (gloo CPU ranks, fp32, tp 2): every collective of our TP layers counts its logical payload in the engine's
`CommStats`; the summary's `plan/measured_tp_payload_bytes/<collective>` must equal
`plan/tp_payload_bytes/<collective>` exactly. The runs cover the code paths that change the count:
    ddp       --mode baseline, no SP, grad accum 2, activation checkpointing, --eval-interval 1 (evaluation
              forwards must not be counted)
    ddp-sp    --mode baseline, --sequence-parallel (overlapped backward), activation checkpointing
    zero3-sp  --mode hybrid ZeRO-3, --sequence-parallel, grad accum 2 (SP gradients summed by per-parameter
              hooks in every micro-step's backward)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train_runs import TINY_ARGS, run_train, summary

pytestmark = pytest.mark.slow
COMMON = TINY_ARGS + ["--data", "synthetic", "--max-steps", "3", "--eval-batches", "1", "--max-samples", "8",
                      "--tp-size", "2"]
TP_RUNS = {
    "ddp": ["--mode", "baseline", "--batch-size", "2", "--grad-accum", "2", "--activation-checkpointing",
            "--eval-interval", "1"],
    "ddp-sp": ["--mode", "baseline", "--batch-size", "2", "--sequence-parallel", "--activation-checkpointing"],
    "zero3-sp": ["--mode", "hybrid", "--batch-size", "1", "--grad-accum", "2", "--sequence-parallel"],
}


def _by_collective(record: dict, prefix: str) -> dict[str, float]:
    return {k.removeprefix(prefix): v for k, v in record.items() if k.startswith(prefix)}


@pytest.mark.parametrize("name", list(TP_RUNS))
def test_tp_bytes_measured_equal_predicted(name: str, tmp_path: Path) -> None:
    run_train(COMMON + TP_RUNS[name] + ["--run-name", name], tmp_path, nproc=2)
    s = summary(tmp_path / name)
    predicted = _by_collective(s, "plan/tp_payload_bytes/")
    measured = _by_collective(s, "plan/measured_tp_payload_bytes/")
    kinds = {"all_reduce", "all_gather", "reduce_scatter"} if "sp" in name else {"all_reduce"}
    assert set(predicted) == kinds, predicted
    assert measured == predicted, (measured, predicted)
    assert s["plan/measured_tp_payload_bytes"] == s["plan/tp_payload_bytes"] > 0
    assert "plan/comm_note" not in s


def test_zero3_bytes_with_comm_log(tmp_path: Path) -> None:
    """ZeRO-3 on 2 ranks (dp 2) with --comm-log: DeepSpeed's comms logger against the planner, per step after
    the first (DeepSpeed records its parameter trace in step 1 and gathers every use separately there:
    measured on CPU, 4x the tied embedding + 3x the persistent parameters, ~4x steady state).

    Steady state: the reduce-scatter carries every gradient once per micro-step; the all-gathers carry the
    partitioned weights once in forward (gpt2-tiny: only the tied embedding is above the persistence
    threshold, and it stays gathered to backward, reused by the LM head within stage3_max_reuse_distance)
    plus the persistent parameters' refresh after the step. Partitions are padded to a multiple of dp, and
    gpt2-tiny's embedding (50304 x 64) needs no padding, so the counts agree exactly; the tolerance (0.1%)
    leaves room only for that padding with other shapes. all_reduce / broadcast (overflow and norm scalars,
    a few hundred bytes) are not predicted.
    """
    run_train(TINY_ARGS + ["--data", "synthetic", "--max-steps", "3", "--eval-batches", "1", "--max-samples", "8",
                           "--mode", "hybrid", "--batch-size", "2", "--comm-log", "--run-name", "z3"],
              tmp_path, nproc=2)
    s = summary(tmp_path / "z3")
    predicted = _by_collective(s, "plan/dp_payload_bytes/")
    measured = _by_collective(s, "plan/measured_dp_payload_bytes/")
    assert set(predicted) == {"all_gather", "reduce_scatter"}, predicted
    for kind, want in predicted.items():
        assert measured[kind] == pytest.approx(want, rel=1e-3), (kind, measured, predicted)
    assert sum(v for k, v in measured.items() if k not in predicted) < 4096  # scalars only
