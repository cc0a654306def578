"""TP + DeepSpeed ZeRO-3 on 4 CPU ranks (TP=2 x DP=2, gloo, fp32) against the single-device model.

The documented recipe (parallel/__init__.py): full model from the seed -> apply_tensor_parallel with
sequence parallelism -> sequence-parallel gradient hooks -> deepspeed.initialize(mpu=ModelParallelUnit),
with ZeRO-3 partitioning each TP shard over its DP group and DeepSpeed clipping the global gradient norm
(which needs the plan's `tensor_model_parallel` marks). Reference: one model, SGD (whose step scales
with the clipped gradient, unlike Adam's), clipped at the same norm, on the mean loss of both DP
replicas' batches. Per-step losses agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from parallel.dims import ParallelDims
from parallel.grads import register_sequence_parallel_grad_hooks
from parallel.mpu import ModelParallelUnit
from tests._tp_harness import spawn
from tests.unit.test_tp_model import B, batch, build

pytestmark = pytest.mark.slow
STEPS, LR, CLIP = 3, 0.5, 0.5


def run_zero3_checks(dims: ParallelDims) -> None:
    from gpt2.engines.deepspeed_engine import import_deepspeed

    deepspeed = import_deepspeed(torch.device("cpu"))
    ref = build()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_losses = []
    for _ in range(STEPS):
        opt_ref.zero_grad(set_to_none=True)
        losses = [ref(*batch(r))[0] for r in range(dims.dp_size)]
        (sum(losses) / dims.dp_size).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt_ref.step()
        ref_losses.append(losses[dims.dp_rank].item())

    model = build(dims, sequence_parallel=True, overlap=True)
    register_sequence_parallel_grad_hooks(model, dims)
    config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              # threshold 0: every parameter, however small, is partitioned and re-gathered (the default 1e5
              # would keep all of this tiny model's parameters whole on every rank: ZeRO-1 in effect)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config, mpu=ModelParallelUnit(dims), dist_init_required=False)
    params = list(model.parameters())
    assert not any(p.ds_persist for p in params)
    assert all(p.ds_tensor.numel() == -(-p.ds_numel // dims.dp_size) for p in params)  # this rank's 1/dp share
    for step, want in enumerate(ref_losses):
        loss, _ = engine(*batch(dims.dp_rank))
        engine.backward(loss)
        engine.step()
        assert abs(loss.item() - want) <= 1e-5, f"step {step}: TP+ZeRO-3 {loss.item()} vs single {want}"


def test_tp_with_zero3_matches_single_device():
    spawn(run_zero3_checks, 4, 2)
