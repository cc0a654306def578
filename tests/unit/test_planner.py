"""gpt2.planning.planner: predicted peak memory against GPU measurements, hand-computed terms, ZeRO-3 holds, --plan /
--search.

Measured peaks (GPT-2 Large, seq 1024, 4 x H200, torch AdamW fused, SDPA, no activation checkpointing;
DDP: bf16 autocast over fp32 weights, --compile per block; ZeRO-3: DeepSpeed bf16, eager or with compiled blocks,
the recipe that is now --zero-precision deepspeed) are from benchmarks/results/train/ (benchmarks/gpu_train_runs.sh,
mem/peak_allocated_gib).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

import train
from gpt2.config.cli import parse_args
from gpt2.config.layout import RunLayout
from gpt2.config.schema import MAX_LAYERS
from gpt2.planning.planner import (
    GIB,
    Hardware,
    compare_with_run,
    make_plan,
    payload_by_collective,
    predict_communication,
    predict_memory,
    search,
    sp_gathered_inputs,
    zero3_fp32_params,
    zero3_held_params,
    zero3_persistent_params,
)
from tools.parity_matrix import PER_BLOCK

LARGE = ["--model", "gpt2-large", "--seq-len", "1024"]
DS16 = ["--mode", "hybrid", "--zero-precision", "deepspeed"]  # the ZeRO recipe of the measured runs
MEASURED_4XH200 = [  # (flags, measured peak allocated GiB)
    (["--mode", "baseline", "--compile", "--batch-size", "8"], 26.76),
    (["--mode", "baseline", "--compile", "--batch-size", "16"], 40.25),
    (["--mode", "baseline", "--compile", "--batch-size", "32"], 67.30),
    ([*DS16, "--batch-size", "8"], 20.47),
    ([*DS16, "--batch-size", "32"], 68.22),
    # ZeRO-3 (+ TP2) with compiled blocks: benchmarks/results/train/zero3_compile_tp_4xh200.md
    ([*DS16, "--compile", "--batch-size", "8"], 14.81),
    ([*DS16, "--compile", "--batch-size", "32"], 44.54),
    ([*DS16, "--compile", "--tp-size", "2", "--batch-size", "8"], 11.67),
    ([*DS16, "--compile", "--tp-size", "2", "--sequence-parallel", "--batch-size", "8"], 10.68),
    ([*DS16, "--compile", "--tp-size", "2", "--batch-size", "32"], 34.93),
]

# GPT-2 Large by hand: d = 1280, 36 layers, 20 heads, vocab padded 50257 -> 50304, 1024 positions.
# Block 12 d^2 + 13 d = 19_660_800 + 16_640 = 19_677_440; x 36 = 708_387_840; wte 50304 x 1280 = 64_389_120;
# wpe 1024 x 1280 = 1_310_720; ln_f 2_560.
N_LARGE = 708_387_840 + 64_389_120 + 1_310_720 + 2_560  # = 774_090_240


def planned(flags: list[str], world_size: int = 4) -> RunLayout:
    """The layout `train.py --plan` resolves for these flags on `world_size` GPUs."""
    return RunLayout.resolve(parse_args(flags), world_size, "cuda")


@pytest.mark.parametrize(("flags", "measured"), MEASURED_4XH200, ids=[" ".join(f) for f, _ in MEASURED_4XH200])
def test_peak_within_15_percent_of_h200_measurement(flags, measured):
    predicted = predict_memory(planned(LARGE + flags)).peak / GIB
    assert abs(predicted - measured) / measured < 0.15, (predicted, measured)


# units of 4 blocks unless said; gathered in fp32, as these were measured
FSDP2 = ["--mode", "hybrid", "--zero-engine", "fsdp2", "--compile", "--fsdp2-gather", "fp32"]
MEASURED_FSDP2 = [  # (flags, world size, measured peak allocated GiB), H200s, torch 2.11
    # benchmarks/results/memory/h200x2-2026-11-27 (benchmarks.memory_phases, backward peak)
    ([*FSDP2, "--batch-size", "8"], 2, 19.32),
    ([*FSDP2, "--batch-size", "16"], 2, 32.17),
    # benchmarks/results/multi_gpu/: call c4 (4 x H200) and the morning's 4 x H100 call (one block a unit)
    ([*FSDP2, "--batch-size", "8"], 4, 17.1),
    ([*FSDP2, "--fsdp2-unit-blocks", "1", "--batch-size", "8"], 4, 16.9),
    ([*FSDP2, "--fsdp2-unit-blocks", "1", "--tp-size", "2", "--batch-size", "8"], 4, 12.9),
    ([*FSDP2, "--fsdp2-unit-blocks", "1", "--tp-size", "2", "--batch-size", "48"], 4, 61.8),
    # the blocks gathered in bf16 (--fsdp2-gather auto on GPUs): call g1, 4 x H200
    (["--mode", "hybrid", "--zero-engine", "fsdp2", "--compile", "--batch-size", "8"], 4, 15.67),
]


@pytest.mark.parametrize(("flags", "world", "measured"), MEASURED_FSDP2,
                         ids=[f"w{w} " + " ".join(f) for f, w, _ in MEASURED_FSDP2])
def test_fsdp2_peak_within_5_percent_of_measurement(flags, world, measured):
    """The FSDP2 planner's target. Before the FSDP2 terms were read off the memory phases (gradients counted at backward
    start, two units and their gradients held), the first and third cases were 15% and 13% high."""
    predicted = predict_memory(planned(LARGE + flags, world)).peak / GIB
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


MEASURED_TP_4XH100 = [  # (flags, measured peak allocated GiB): benchmarks/results/multi_gpu, call D, --compile
    # DeepSpeed's rows ran one block a leaf, before leaf units of 4 were the default
    (["--tp-size", "2", *PER_BLOCK, "--batch-size", "48"], 64.02),
    (["--tp-size", "2", "--sequence-parallel", *PER_BLOCK, "--batch-size", "48"], 57.37),
    # FSDP2 + TP2 at batch 48 (61.14 GiB) ran one compiled graph a block, before its units were one graph each; no flag
    # gives that layout back, and today's plan for it is 3.2 GiB higher by the unit-graph term: not re-measured yet
]


@pytest.mark.parametrize(("flags", "measured"), MEASURED_TP_4XH100, ids=[" ".join(f) for f, _ in MEASURED_TP_4XH100])
def test_tp_peak_within_2_percent_of_h100_measurement(flags, measured):
    """The largest-batch TP rows of 4x H100 call D. With sequence parallelism the plan was 52.9 GiB (7.9% low) while
    it assumed every column-parallel layer keeps only its input's sequence shard; under --compile each keeps the
    all-gathered input (`sp_gathered_inputs`)."""
    predicted = predict_memory(planned(LARGE + ["--mode", "hybrid", "--compile", *flags])).peak / GIB
    assert abs(predicted - measured) / measured < 0.02, (predicted, measured)


def test_sp_keeps_gathered_inputs_where_the_plain_path_runs():
    """Eager with --tp-overlap only the GELU'd MLP up-projection keeps its gathered input; compiled, c_attn too (the
    LM head stays eager); without overlap, every column layer: one [b, s, d] bf16 tensor less its shard, per such
    layer. Each layer that keeps only its shard all-gathers it again in backward."""
    sp = LARGE + ["--mode", "hybrid", "--tp-size", "2", "--sequence-parallel", "--batch-size", "8"]
    eager, no_overlap = predict_memory(planned(sp)), predict_memory(planned(sp + ["--no-tp-overlap"]))
    half_input = 2 * 8 * 1024 * 1280 / 2  # bf16 [b, s, d] minus its shard at tp 2
    assert no_overlap.activations - eager.activations == (36 + 1) * half_input
    compiled = sp_gathered_inputs(planned(sp + ["--compile"]))
    assert (compiled.per_block, compiled.lm_head, compiled.regathered(36)) == (2, 0, 1)
    assert sp_gathered_inputs(planned(sp)).regathered(36) == 36 + 1  # eager: c_attn's and the head's shards
    assert sp_gathered_inputs(planned(sp + ["--no-tp-overlap"])).regathered(36) == 0
    regathers = {op.calls for op in predict_communication(planned(sp + ["--compile"])) if "recomputed" in op.name}
    assert regathers == {1}
    assert sp_gathered_inputs(planned(sp[:-3] + ["--batch-size", "8"])).per_block == 0  # no SP: nothing gathered


def test_activation_checkpointing_recomputes_a_unit_at_a_time():
    """GPT.forward checkpoints each entry of model.blocks, under ZeRO-3's units of 4 (the default) a whole unit: 9
    units for GPT-2 Large's 36 blocks. The recompute reruns each block's MLP-output all-reduce but the unit's last
    (torch's non-reentrant checkpoint stops at the last saved tensor), and holds one unit's activations at a time
    beside the 9 saved unit inputs (per block: 36 inputs, one block at a time)."""
    ac = LARGE + ["--mode", "hybrid", "--tp-size", "2", "--batch-size", "8", "--activation-checkpointing"]
    per_block, units = planned(ac + list(PER_BLOCK)), planned(ac)
    assert (per_block.zero3_unit_blocks, units.zero3_unit_blocks) == (1, 4)

    def recomputed(layout: RunLayout) -> int:
        return {op.name: op.calls for op in predict_communication(layout)}["activation all-reduce"]

    assert recomputed(units) - recomputed(per_block) == 36 - 9
    saved_input = 4 * 8 * 1024 * 1280  # one fp32 residual-stream [b, s, d] (autocast), replicated at TP 2 without SP
    no_ac = predict_memory(planned([f for f in ac if f != "--activation-checkpointing"] + list(PER_BLOCK)))
    layer = (no_ac.activations - predict_memory(per_block).activations + 36 * saved_input) / 35
    assert predict_memory(units).activations - predict_memory(per_block).activations == pytest.approx(
        3 * layer - 27 * saved_input)


def test_fsdp2_checkpoints_flat_units_whole_and_its_own_tensors_block_by_block():
    """Under FSDP2, --activation-checkpointing recomputes a flat unit whole (GPT.forward's checkpoint, as ZeRO-3's
    leaf units: RunLayout.checkpointed_blocks) but one block at a time over FSDP2's own tensors: the recomputed
    collectives and the activations held follow."""
    ac = LARGE + ["--mode", "hybrid", "--zero-engine", "fsdp2", "--tp-size", "2", "--batch-size", "8",
                  "--activation-checkpointing"]
    flat, tensors = planned(ac), planned(ac + ["--fsdp2-params", "tensors"])
    assert (flat.checkpointed_blocks, tensors.checkpointed_blocks) == (4, 1)

    def recomputed(layout: RunLayout) -> int:
        return {op.name: op.calls for op in predict_communication(layout)}["activation all-reduce"]

    assert recomputed(flat) - recomputed(tensors) == 36 - 9
    # 9 saved unit inputs and one unit of 4 blocks recomputed, against 36 saved block inputs and one block
    saved_input = 4 * 8 * 1024 * 1280  # one fp32 residual-stream [b, s, d] (autocast), replicated at TP 2 without SP
    no_ac = predict_memory(planned([f for f in ac if f != "--activation-checkpointing"]))
    layer = (no_ac.activations - predict_memory(tensors).activations + 36 * saved_input) / 35
    assert predict_memory(flat).activations - predict_memory(tensors).activations == pytest.approx(
        3 * layer - 27 * saved_input)


def test_ddp_terms_by_hand():
    mem = predict_memory(planned(LARGE + ["--mode", "baseline", "--compile"]))
    # autocast over fp32 weights: 4 B weights + 4 B grads + 8 B AdamW moments, 2 B bf16 copies of the weights
    assert (mem.params, mem.grads, mem.optimizer, mem.weight_copies) == (4 * N_LARGE, 4 * N_LARGE, 8 * N_LARGE,
                                                                         2 * N_LARGE)
    # 8 x 1024 = 8192 tokens; sbh = 8192 x 1280 = 10_485_760. Per block (compiled, autocast): 34 B x sbh =
    # 356_515_840 + fp32 log-sum-exp 4 x 20 heads x 8192 = 655_360 -> 357_171_200; x 36 = 12_858_163_200;
    # + ln_f input (fp32) and output (bf16) 6 x sbh = 62_914_560.
    assert mem.activations == 12_858_163_200 + 62_914_560
    # compiled loss: bf16 logits + bf16 gradient, 8192 x 50304 x 4 B = 1_648_361_472
    assert mem.logits == 1_648_361_472


def test_zero3_autocast_terms_by_hand():
    layout = planned(LARGE + ["--mode", "hybrid"])
    mem = predict_memory(layout)
    # torch_autocast: fp32 weights and grads + 2 fp32 moments, all over dp = 4
    assert (mem.params, mem.grads, mem.optimizer) == (4 * N_LARGE / 4, 4 * N_LARGE / 4, 8 * N_LARGE / 4)
    # eager autocast block: 36 B x sbh = 377_487_360 + lse 655_360 -> 378_142_720; x 36 = 13_613_137_920;
    # ln_f in (fp32) / out (bf16) 6 x sbh = 62_914_560
    assert mem.activations == 13_613_137_920 + 62_914_560
    # autocast's bf16 copy of every (gathered, full) weight + the fp32 gathered weights held to their backward
    assert mem.weight_copies == 2 * N_LARGE + 4 * zero3_held_params(layout)
    assert mem.step_transient == 0  # the gradients are fp32 already
    # the gathers and reductions carry the Linear weights in bf16 and the embeddings and LayerNorms in fp32: 2 more
    # bytes than the 16-bit model for each of those (50304 x 1280 + 1024 x 1280 + 146 x 1280) elements
    zero = {op.name: op.message_bytes * op.calls for op in predict_communication(layout) if op.group == "dp"}
    bytes_16 = {op.name: op.message_bytes * op.calls for op in predict_communication(planned(LARGE + DS16))
                if op.group == "dp"}
    fp32_excess = 2 * (50304 + 1024 + 146) * 1280
    assert zero["grad reduce-scatter"] == bytes_16["grad reduce-scatter"] + fp32_excess
    assert zero["param all-gather (fwd)"] == bytes_16["param all-gather (fwd)"] + fp32_excess
    assert zero["param all-gather (bwd)"] == bytes_16["param all-gather (bwd)"]


@pytest.mark.parametrize("flags, measured", [
    ([], {"reduce_scatter": 1_679_953_920}),
    (["--tp-size", "2"], {"reduce_scatter": 843_064_320, "all_gather": 843_064_320}),
    (["--zero-engine", "fsdp2"], {"reduce_scatter": 3_096_360_960, "all_gather": 3_096_360_960}),
    (["--zero-engine", "fsdp2", "--tp-size", "2"], {"reduce_scatter": 1_551_360_000, "all_gather": 1_551_360_000}),
])
def test_zero_bytes_are_what_comm_log_measured_on_4_gpus(flags, measured):
    """ZeRO's bytes per step as `--comm-log` counted them on 4x H100 (GPT-2 Large, batch 8, bf16;
    benchmarks/results/multi_gpu/comm_log_h100x4_2026-11-28). DeepSpeed ZeRO-3's all-gather is left out: the
    planner's backward re-gathers (515 MiB) do not happen (DeepSpeed keeps its leaf blocks gathered; see there)."""
    predicted = payload_by_collective(predict_communication(planned(LARGE + ["--batch-size", "8", "--mode", "hybrid",
                                                                          *flags])), "dp")
    assert {k: predicted[k] for k in measured} == measured


def test_fsdp2_terms_by_hand():
    """FSDP2 (--zero-engine fsdp2) holds ZeRO-3's sharded weights and optimizer states at both stages, and no
    gradient when backward starts (its reduce-scatters make the shards, counted at the optimizer step); it gathers
    (--fsdp2-gather fp32) and reduces in fp32; when backward starts its stage 3 holds the root unit and the last
    block unit (--fsdp2-unit-blocks blocks, default 4) gathered, its stage 2 the whole model."""
    from gpt2.planning.perf_model import local_block_params
    from gpt2.planning.planner import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES, fsdp2_units, make_plan

    fsdp2 = LARGE + ["--mode", "hybrid", "--zero-engine", "fsdp2", "--fsdp2-gather", "fp32"]
    z3 = planned(fsdp2)
    z2 = planned(fsdp2 + ["--zero-stage", "2", "--grad-accum", "2"])
    last_unit, root = fsdp2_units(z3)
    block = local_block_params(z3)
    assert last_unit == 4 * block
    for unit_blocks, blocks in ((1, 1), (5, 1), (18, 18), (36, 36)):  # 36 = 7 x 5 + 1: the last unit holds one
        given = ["--fsdp2-params", "tensors", "--fsdp2-unit-blocks", str(unit_blocks)]  # flat units divide the blocks
        assert fsdp2_units(planned(fsdp2 + given))[0] == blocks * block
    assert 36 * block + root == N_LARGE  # every parameter once
    deepspeed = predict_memory(planned(LARGE + ["--mode", "hybrid"]))
    m3, m2 = predict_memory(z3), predict_memory(z2)
    for m in (m3, m2):
        assert (m.params, m.optimizer, m.step_transient) == (deepspeed.params, deepspeed.optimizer, deepspeed.grads)
        # the forward's and the backward thread's cuBLAS workspaces; FSDP2's own buffers are the gathered units
        assert m.workspace == CUBLAS_WORKSPACES * CUBLAS_WORKSPACE_BYTES
    assert m3.grads == 0  # none exists before the backward's reduce-scatters
    assert m2.grads == 4 * N_LARGE  # --grad-accum 2: every unit's unsharded fp32 gradient kept across micro-steps
    assert m3.weight_copies == 2 * N_LARGE + 4 * (root + last_unit)  # autocast's bf16 copies + held fp32 units
    assert m2.weight_copies == 2 * N_LARGE + 4 * N_LARGE  # every unit held from its forward to its backward
    assert make_plan(z2, 80).checkpoint_bytes == make_plan(z3, 80).checkpoint_bytes
    n = 36 * block + root
    ops3 = {op.name: op for op in predict_communication(z3) if op.group == "dp"}
    assert ops3["FSDP2 param all-gather (fwd)"].message_bytes == 4 * n  # fp32
    assert ops3["FSDP2 param all-gather (bwd)"].message_bytes == 4 * (n - root)  # the root stays gathered
    ops2 = {op.name: op for op in predict_communication(z2) if op.group == "dp"}
    assert "FSDP2 param all-gather (bwd)" not in ops2 and ops2["FSDP2 param all-gather (fwd)"].calls == 2
    assert ops2["FSDP2 grad reduce-scatter"].calls == 1  # once a step: no sync on the first micro-step


def test_fsdp2_bf16_gather_terms_by_hand():
    """--fsdp2-gather bf16 (auto's choice on GPUs): the blocks' gathered weights are 2 B and are what their matmuls
    save (no autocast copies); the root stays fp32 with autocast's copy; gradients still reduce in fp32."""
    from gpt2.planning.planner import fsdp2_units

    fsdp2 = LARGE + ["--mode", "hybrid", "--zero-engine", "fsdp2"]
    bf16, fp32 = planned(fsdp2), planned(fsdp2 + ["--fsdp2-gather", "fp32"])
    last_unit, root = fsdp2_units(bf16)
    m, m32 = predict_memory(bf16), predict_memory(fp32)
    assert (m.params, m.grads, m.optimizer, m.activations, m.step_transient) == (
        m32.params, m32.grads, m32.optimizer, m32.activations, m32.step_transient)
    assert m.weight_copies == 2 * root + 4 * root + 2 * last_unit
    # recomputation under activation checkpointing makes no block copies either
    assert predict_memory(planned(fsdp2 + ["--activation-checkpointing"])).weight_copies == m.weight_copies
    assert predict_memory(planned(fsdp2 + ["--zero-stage", "2"])).weight_copies == 2 * root + 4 * root + 2 * (
        N_LARGE - root)  # every block unit held in bf16 from its forward to its backward
    ops = {op.name: op for op in predict_communication(bf16) if op.group == "dp"}
    ops32 = {op.name: op for op in predict_communication(fp32) if op.group == "dp"}
    assert ops["FSDP2 param all-gather (fwd)"].message_bytes == 4 * root + 2 * (N_LARGE - root)
    assert ops["FSDP2 param all-gather (bwd)"].message_bytes == 2 * (N_LARGE - root)
    assert ops["FSDP2 grad reduce-scatter"] == ops32["FSDP2 grad reduce-scatter"]  # fp32


def test_zero3_deepspeed_16bit_terms_by_hand():
    mem = predict_memory(planned(LARGE + DS16))
    # bf16 weights and grads, fp32 master + 2 moments, all over dp = 4
    assert (mem.params, mem.grads, mem.optimizer) == (2 * N_LARGE / 4, 2 * N_LARGE / 4, 12 * N_LARGE / 4)
    # all-bf16 block: 32 B x sbh = 335_544_320 + lse 655_360 -> 336_199_680; x 36 = 12_103_188_480;
    # ln_f in/out 4 x sbh = 41_943_040. Eager loss: fp32 log-softmax + two fp32 gradients, 12 B x 8192 x 50257.
    assert mem.activations == 12_103_188_480 + 41_943_040
    assert mem.logits == 12 * 8192 * 50257
    # workspace: two cuBLAS workspaces of 32 MiB + one (bf16) reduce bucket of 5e7 + prefetch bucket 3e7 bf16 elements
    assert mem.workspace == 2 * 32 * 2**20 + 2 * 50_000_000 + 2 * 30_000_000
    assert mem.step_transient == 4 * N_LARGE / 4


TINY = ["--model", "gpt2-tiny"]  # 2 layers, d = 64, 256 positions


@pytest.mark.parametrize(("distance", "expected"), [
    (0, 0),
    # Module order (elements): wte 3_219_456, wpe 16_384, per layer ln_1 128, c_attn 12_480, attn c_proj 4_160
    # (persistent below 10_000), ln_2 128, c_fc 16_640, mlp c_proj 16_448; ln_f 128; lm_head = wte again.
    # 50_000: only the LM head's wte, reused at once by its own backward.
    (50_000, 3_219_456),
    # 6_500_000: layer 1's c_fc / mlp c_proj reach their backward after 6_472_064 / 6_439_168 elements
    # (two passes of wte in between); its c_attn needs 6_513_920.
    (6_500_000, 3_219_456 + 16_640 + 16_448),
    # everything partitioned: wte, wpe and both layers' c_attn, c_fc, mlp c_proj
    (10**9, 3_219_456 + 16_384 + 2 * (12_480 + 16_640 + 16_448)),
])
def test_zero3_reuse_distance_holds(distance, expected, tmp_path: Path):
    """DeepSpeed's reuse-distance rule decides per module (--zero3-fetch module); with blocks as leaf modules every
    partitioned parameter is held, whatever the distance (per parameter: the 64-256-element biases persist)."""
    ds = tmp_path / "zero3.json"  # the settings come from the run's DeepSpeed file, as DeepSpeed reads them
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10_000,
                                                    "stage3_max_reuse_distance": distance}}))
    hybrid = TINY + ["--mode", "hybrid", "--ds-config", str(ds)]
    assert zero3_held_params(planned(hybrid + ["--zero3-fetch", "module"], world_size=2)) == expected
    leaf = planned(hybrid + ["--zero3-fetch", "flat"], world_size=2)
    assert zero3_held_params(leaf) == 3_219_456 + 16_384 + 2 * (12_288 + 16_384 + 16_384)


def test_persistence_threshold_includes_its_own_size(tmp_path: Path):
    """DeepSpeed persists a parameter of `ds_numel <= stage3_param_persistence_threshold` (partition_parameters.py):
    at 1280, GPT-2 Large's LayerNorm vectors and the two 1280-wide row biases of each block, and ln_f's two."""
    ds = tmp_path / "zero3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1280}}))
    layout = planned(LARGE + ["--mode", "hybrid", "--ds-config", str(ds)])
    assert zero3_persistent_params(layout) == (6 * 36 + 2) * 1280
    assert zero3_fp32_params(layout)[1] == (4 * 36 + 2) * 1280  # of those, the LayerNorms travel in fp32


@pytest.mark.timeout(120)  # linear: seconds at 100k layers; a scan per module per layout ran for hours
def test_plan_and_search_are_linear_in_layers(capsys):
    deep = ["--plan", "--search", "--mode", "hybrid", "--gpus", "4", "--n-layer", str(MAX_LAYERS)]
    assert train.main(deep) == 0 and "layouts fit" in capsys.readouterr().out
    cfg = parse_args(deep)
    deeper = RunLayout.resolve(replace(cfg, model=replace(cfg.model, n_layer=100_000)), 4, "cuda")
    assert zero3_held_params(deeper) > 0
    assert train.main(["--plan", "--n-layer", str(MAX_LAYERS + 1)]) == 2
    assert f"--n-layer {MAX_LAYERS + 1}: at most {MAX_LAYERS:,}" in capsys.readouterr().err


def test_plan_cli_prints_terms_without_launching(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # --gpus wins over the launcher's variable
    assert train.main(LARGE + ["--plan", "--mode", "hybrid", "--gpus", "4", "--gpu-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "zero3, 4 GPUs (tp 1 x dp 4)" in out
    assert re.search(r"parameters\s+0\.72\n", out)  # fp32: 4 x 774_090_240 / 4 bytes = 0.721 GiB
    assert "fits in 141.0 GiB" in out
    assert "dp param all-gather (fwd)" in out and "dp grad reduce-scatter" in out
    assert train.main(LARGE + ["--plan", "--mode", "baseline", "--batch-size", "64", "--gpu-memory-gib", "80"]) == 0
    assert "DOES NOT FIT in 80.0 GiB" in capsys.readouterr().out
    # the launch-time checks apply: --global-batch-size sets the accumulation for the planned world size
    assert train.main(["--plan", "--mode", "baseline", "--gpus", "4", "--global-batch-size", "64"]) == 0
    assert "micro-batch 8 x accum 2" in capsys.readouterr().out
    assert train.main(["--plan", "--mode", "single", "--gpus", "4"]) == 2
    # and the model/sequence checks of a real launch: a plan for a layout train.py would refuse is refused
    capsys.readouterr()
    assert train.main(LARGE + ["--plan", "--mode", "hybrid", "--gpus", "6", "--tp-size", "3"]) == 2
    assert "--tp-size 3 does not divide n_head = 20" in capsys.readouterr().err
    assert train.main(LARGE + ["--plan", "--mode", "hybrid", "--gpus", "4", "--tp-size", "2", "--sequence-parallel",
                               "--seq-len", "1023"]) == 2
    assert "--sequence-parallel needs --seq-len divisible by --tp-size 2" in capsys.readouterr().err


def test_search_ranks_fitting_layouts_by_step_time(capsys):
    # GPT-2 (124M) on 16 GPUs = 2 nodes, global batch 64 x 1024, 12 GiB per GPU, nearly no bandwidth across
    # nodes: data-parallel bytes dominate, so the fastest layouts shard most (TP 4: the largest TP size that
    # divides 12 heads) and avoid DDP's fp32 all-reduce and ZeRO-3's per-micro-batch gathers.
    cfg = parse_args(["--model", "gpt2", "--seq-len", "1024", "--global-batch-size", "64"])
    hw = Hardware(gpu_memory_gib=12, achievable_tflops=400, busbw_intra_gbs=300, busbw_inter_gbs=0.5)
    ranked = search(cfg, 16, 64, hw)
    assert ranked and all(c.plan.fits and c.plan.memory.peak <= 0.95 * 12 * GIB for c in ranked)
    times = [c.step_s for c in ranked]
    assert times == sorted(times)
    best = ranked[0].plan.layout
    # ZeRO-3 ties with 1/2 on time (gpt2/config/ds_configs/zero3.json keeps gathered weights to backward, so its DP
    # traffic hides under compute too) and wins on memory
    assert best.tp_size == 4 and best.mode == "hybrid"
    # compute time by hand: (6 N + 12 L d T) FLOPs/token, N = 12 x (12 d^2 + 13 d) + 2 d + 50257 d (unpadded)
    n = 12 * (12 * 768**2 + 13 * 768) + 2 * 768 + 50257 * 768
    fpt = 6 * n + 12 * 12 * 768 * 1024
    no_ckpt = next(c for c in ranked if not c.plan.layout.cfg.train.activation_checkpointing)
    assert no_ckpt.compute_s == pytest.approx(fpt * 64 * 1024 / (16 * 400e12))
    # nothing fits in 50 MiB (the cuBLAS workspace alone is 32 MiB)
    assert search(cfg, 16, 64, Hardware(gpu_memory_gib=0.05)) == []

    assert train.main(["--model", "gpt2", "--seq-len", "1024", "--global-batch-size", "64", "--plan", "--search",
                       "--gpus", "16", "--gpu-memory-gib", "12", "--busbw-gbs", "300", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "assumptions: 400 TFLOP/s" in out and "0.5 GB/s for a group spanning nodes" in out
    assert re.search(r"\| 1 \| zero[123]-tp4", out)


def test_compare_with_run():
    plan = make_plan(planned(LARGE + ["--mode", "hybrid", "--tp-size", "2"]), 141)
    record = compare_with_run(plan, {"mem/peak_allocated_gib": 10.0, "device": "NVIDIA H200"}, None)
    assert record["plan/peak_error"] == pytest.approx(plan.memory.peak / GIB / 10.0 - 1)
    assert record["plan/measured_tp_payload_bytes"] is None and "predicted only" in record["plan/comm_note"]
    assert record["plan/tp_payload_bytes"] > 0
    on_cpu = compare_with_run(plan, {"mem/peak_allocated_gib": 10.0, "device": "cpu"},
                              {"all_gather": 100.0, "all_reduce": 23.0})
    assert on_cpu["plan/peak_error"] is None and on_cpu["plan/measured_tp_payload_bytes"] == 123.0
    assert on_cpu["plan/measured_tp_payload_bytes/all_gather"] == 100.0 and "plan/comm_note" not in on_cpu
    assert sum(v for k, v in record.items() if k.startswith("plan/tp_payload_bytes/")) == pytest.approx(
        record["plan/tp_payload_bytes"])


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results"
SIMULATED_RANKS = {  # run folder -> (world size, the layout's flags): GPT-2 Large, batch 8, --compile, one H200
    # simulated rank 0 of 4 GPUs (ZeRO-3 measured with the 4-block unit graphs FSDP2 has had since)
    "simulated/h200-2026-12-01/runs/zero3-dp4-b8": (4, []),
    "simulated/h200-2026-12-01/runs/zero3-tp2-b8": (4, ["--tp-size", "2"]),
    "simulated/h200-2026-12-01/runs/zero3-tp2-sp-b8": (4, ["--tp-size", "2", "--sequence-parallel"]),
    "simulated/h200-2026-12-02-cB/runs/fsdp2-tp2-b8": (4, ["--zero-engine", "fsdp2", "--tp-size", "2"]),
    # a real one-GPU FSDP2 run of the same code
    "kernels/e2e-h200-2026-12-02-cB/runs/fsdp2-none-b8": (1, ["--zero-engine", "fsdp2"]),
}


@pytest.mark.parametrize("run", SIMULATED_RANKS)
def test_simulated_rank_peak_within_3_percent(run: str):
    """Simulated ranks (tools.simulate_rank: one rank of a 4-GPU layout on one H200, its collectives moving nothing;
    its memory is that rank's) and a real one-GPU run. Before the terms of docs/decisions.md's planner section
    (DeepSpeed's reduce bucket per communication dtype, a leaf unit's weights held to backward, the per-part head's
    one logits buffer, the backward thread's cuBLAS workspace, the residual stream inside a unit's graph) the plan was
    -5.0%, -4.8%, -3.2% off for the ZeRO-3 rows; without the last term for FSDP2's unit graphs, -4.7% and -2.6% for
    the FSDP2 rows."""
    summary = json.loads((RESULTS / run / "summary.json").read_text())
    world_size, layout_flags = SIMULATED_RANKS[run]
    flags = LARGE + ["--mode", "hybrid", "--compile", "--batch-size", "8", *layout_flags]
    layout = planned(flags, world_size)
    assert (layout.tp_size, layout.sequence_parallel, layout.zero_engine, layout.zero3_fetch) == (
        summary["tp_size"], summary["sequence_parallel"], summary["zero_engine"], summary["zero3_fetch"])
    measured = summary["mem/peak_allocated_gib"]
    predicted = predict_memory(layout).peak / GIB
    assert abs(predicted - measured) / measured < 0.03, (predicted, measured)


SINGLE_RUNS = [  # one H200, GPT-2 Large, --compile (scope model: the whole model one Inductor graph)
    "kernels/e2e-h200-2026-12-02-cB/runs/single-none-b8",
    "kernels/e2e-h200-2026-12-02-cC/runs/single-none-b8",
    # the Triton loss in the whole-model graph at batch 8, 32 and 64, measured while its chunk loop still held two
    # chunks at once (one more than it holds now)
    "kernels/e2e-h200-2026-12-02-i2/sweep-b8/runs/single-triton-b8",
    "kernels/e2e-h200-2026-12-02-i2/sweep-b32/runs/single-triton-b32",
    "kernels/e2e-h200-2026-12-02-i3/sweep-b64/runs/single-triton-b64",
]


@pytest.mark.parametrize("run", SINGLE_RUNS)
def test_single_whole_graph_peak_within_3_percent(run: str):
    """`--mode single --compile` on one H200. The plan was +11.4% (no fused kernels) and +6.7% (Triton) while it counted
    the fp32 gradients when backward starts (single's zero_grad sets them to None: `gradients_made_in_backward`) and,
    with --fused-kernels triton, the chunked loss where Inductor compiles its own (`inductor_head`)."""
    summary = json.loads((RESULTS / run / "summary.json").read_text())
    flags = LARGE + ["--mode", summary["mode"], "--compile", "--batch-size", str(summary["batch_size_per_gpu"]),
                     "--fused-kernels", summary["fused_kernels"], "--precision", summary["precision"]]
    layout = planned(flags, summary["world_size"])
    assert (layout.compile_scope, layout.grad_accum, layout.cfg.train.activation_checkpointing) == (
        summary["compile"], summary["grad_accum"], summary["activation_checkpointing"])
    measured = summary["mem/peak_allocated_gib"]
    predicted = predict_memory(layout).peak / GIB
    assert abs(predicted - measured) / measured < 0.03, (predicted, measured)


def test_single_gradients_count_at_the_step_only():
    """Single's gradients are made during backward (set to None after each step); DDP's are views of its buckets,
    alive from construction; with accumulation single keeps them across micro-steps. The Triton loss holds one chunk
    of logits wherever it runs, and in a whole-model graph one 16-bit [N, Vp] besides (measured, not named), where
    Inductor's own loss keeps every logit and its gradient."""
    single = predict_memory(planned(LARGE + ["--mode", "single", "--compile"], 1))
    ddp = predict_memory(planned(LARGE + ["--mode", "baseline", "--compile"], 1))
    assert (single.grads, single.step_transient) == (0, ddp.grads) and ddp.step_transient == 0
    assert ddp.backward_peak - single.backward_peak == 4 * N_LARGE
    assert single.step_peak == single.states + 4 * N_LARGE + single.workspace
    accum = predict_memory(planned(LARGE + ["--mode", "single", "--compile", "--grad-accum", "2"], 1))
    assert (accum.grads, accum.step_transient) == (4 * N_LARGE, 0)
    whole = LARGE + ["--mode", "single", "--compile", "--batch-size", "32"]
    triton = predict_memory(planned(whole + ["--fused-kernels", "triton"], 1))
    assert triton.logits < predict_memory(planned(whole, 1)).logits  # one chunk + one [N, Vp]: not two [N, Vp]
    # per-block graphs: the head's own graph keeps only the 16-bit logits, as much as one chunk and grad_W at batch 8
    blocks = ["--mode", "single", "--compile", "--compile-scope", "blocks", "--batch-size", "32"]
    assert predict_memory(planned(LARGE + blocks + ["--fused-kernels", "triton"], 1)).logits < predict_memory(
        planned(LARGE + blocks, 1)).logits
