"""GPU: tensor parallelism under --compile trains single's function on 2 GPUs (NCCL), DDP and ZeRO-3, +- sequence
parallelism, and FSDP2; the ZeRO-3 engines' graphs with either launch code (C++ by default on CUDA). On torch 2.11
without parallel.comm's views (pytorch/pytorch#184113) the blocks got no gradient: on 4 H200s the step-1 gradient
norm read 2.67 against single's 23.9 and the loss ended 1.78 off.

Runs tests/train_runs.REFERENCE_ARGS (gpt2-tiny, fp32, seq 32, lr 3e-3, 10 steps, clip active) on the GPU: single
eager on one GPU, each TP row on two (dp 1, the same batch of 4). fp32 on a GPU without TF32 (PyTorch's default):
only the reduction order differs, so the CPU tests' tolerances hold with room: loss <= 1e-4 relative, pre-clip
gradient norm <= 1e-2 relative (the bug: 89% off at step 1).
"""

from __future__ import annotations

import pytest
import torch

from tests.train_runs import (
    REFERENCE_ARGS,
    REFERENCE_BATCH,
    ReferenceRun,
    assert_matches_reference,
    gpu_train_env,
    run_train,
    train_reference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
GPU_ARGS = ["cuda" if a == "cpu" else a for a in REFERENCE_ARGS]
TP2 = ["--tp-size", "2", "--batch-size", str(REFERENCE_BATCH), "--compile"]
ROWS = {
    "ddp-tp2-compile": ["--mode", "baseline", *TP2],
    "ddp-tp2-sp-compile": ["--mode", "baseline", *TP2, "--sequence-parallel"],
    "zero3-tp2-compile": ["--mode", "hybrid", *TP2],
    "zero3-tp2-sp-compile": ["--mode", "hybrid", *TP2, "--sequence-parallel"],
    # the ZeRO-3 engines' TP graphs launch from C++ on CUDA (--compile-wrapper auto); Python stays a choice
    "zero3-tp2-compile-python": ["--mode", "hybrid", *TP2, "--compile-wrapper", "python"],
    "fsdp2-tp2-compile": ["--mode", "hybrid", "--zero-engine", "fsdp2", *TP2],
}


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory) -> ReferenceRun:
    root = tmp_path_factory.mktemp("gpu-reference")
    return train_reference(root, GPU_ARGS, env=gpu_train_env())


@pytest.mark.parametrize("name", list(ROWS))
def test_tp2_compiled_matches_single_on_two_gpus(gpu_reference: ReferenceRun, tmp_path, name: str) -> None:
    run_train(GPU_ARGS + ROWS[name] + ["--run-name", name], tmp_path, nproc=2, env=gpu_train_env())
    assert_matches_reference(gpu_reference, tmp_path / name, grad_norm_rel_tol=1e-2, loss_rel_tol=1e-4)
