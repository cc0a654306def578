"""Measured communication bytes per training step (train.py summary) against the planner's prediction.

TP (gloo CPU ranks, fp32, tp 2): every collective of our TP layers counts its logical payload in the engine's
`CommStats`; the summary's `plan/measured_tp_payload_bytes/<collective>` must equal
`plan/tp_payload_bytes/<collective>` exactly. The runs cover the code paths that change the count:
    ddp       --mode baseline, no SP, grad accum 2, activation checkpointing, --eval-interval 1 (evaluation
              forwards must not be counted)
    ddp-sp    --mode baseline, --sequence-parallel (overlapped backward), activation checkpointing
    zero3-sp  --mode hybrid ZeRO-3, --sequence-parallel, grad accum 2 (SP gradients summed by per-parameter
              hooks in every micro-step's backward)
ZeRO-3's data-parallel bytes (--comm-log, DeepSpeed's comms logger) against the planner: a test of
tests/integration/test_zero.py on its ZeRO-3 run; FSDP2's in tests/integration/test_fsdp2.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train_runs import TINY_ARGS, by_collective, run_train, summary

pytestmark = pytest.mark.slow
COMMON = TINY_ARGS + ["--data", "synthetic", "--max-steps", "3", "--eval-batches", "1", "--max-samples", "8",
                      "--tp-size", "2"]
TP_RUNS = {
    "ddp": ["--mode", "baseline", "--batch-size", "2", "--grad-accum", "2", "--activation-checkpointing",
            "--eval-interval", "1"],
    "ddp-sp": ["--mode", "baseline", "--batch-size", "2", "--sequence-parallel", "--activation-checkpointing"],
    "zero3-sp": ["--mode", "hybrid", "--batch-size", "1", "--grad-accum", "2", "--sequence-parallel"],
}


@pytest.mark.parametrize("name", list(TP_RUNS))
def test_tp_bytes_measured_equal_predicted(name: str, tmp_path: Path) -> None:
    run_train(COMMON + TP_RUNS[name] + ["--run-name", name], tmp_path, nproc=2)
    s = summary(tmp_path / name)
    predicted = by_collective(s, "plan/tp_payload_bytes/")
    measured = by_collective(s, "plan/measured_tp_payload_bytes/")
    kinds = {"all_reduce", "all_gather", "reduce_scatter"} if "sp" in name else {"all_reduce"}
    assert set(predicted) == kinds, predicted
    assert measured == predicted, (measured, predicted)
    assert s["plan/measured_tp_payload_bytes"] == s["plan/tp_payload_bytes"] > 0
    assert "plan/comm_note" not in s
