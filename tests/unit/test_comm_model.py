"""gpt2.planning.perf_model against hand calculations for a 7B GPT (32 layers, d=4096, 32 heads), B=128 sequences
of L=4096 tokens, 16-bit weights/grads/activations, fp32 AdamW states, flash attention, no dropout, 8 GPUs.
The layouts are RunLayouts, resolved as a launch on 8 GPUs would be.

Every expected number is spelled out below from the formulas, not from the module's helpers.
"""

from __future__ import annotations

import pytest

from gpt2.config.layout import RunLayout
from gpt2.config.schema import MODEL_PRESETS, DataConfig, LogConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from gpt2.model.flops import param_count
from gpt2.model.gpt import GPT
from gpt2.planning.perf_model import (
    bus_factor,
    comm_time,
    layer_activation_bytes,
    local_params,
    memory_per_gpu,
    step_communication,
)

CFG_7B = ModelConfig(n_layer=32, n_head=32, n_embd=4096, n_positions=4096)
BATCH, SEQ, GPUS = 128, 4096, 8  # sequences per optimizer step, all data-parallel replicas together


def layout_7b(tp: int = 1, zero_stage: int | None = None, sequence_parallel: bool = False,
              activation_checkpointing: bool = False) -> RunLayout:
    """The 7B model on 8 GPUs, BATCH sequences per step split over the data-parallel replicas: DDP, or ZeRO."""
    dp = GPUS // tp
    train = TrainConfig(mode="hybrid" if zero_stage else "baseline", batch_size=BATCH // dp, seq_len=SEQ,
                        activation_checkpointing=activation_checkpointing)
    parallel = ParallelConfig(tp_size=tp, sequence_parallel=sequence_parallel, zero_stage=zero_stage or 3)
    cfg = RunConfig(train=train, model=CFG_7B, data=DataConfig(), parallel=parallel, log=LogConfig())
    return RunLayout.resolve(cfg, GPUS, "cuda")

# Parameters. d = 4096, d^2 = 16_777_216.
# One block: QKV 3d^2+3d, attn-out d^2+d, MLP up 4d^2+4d, down 4d^2+d, 2 LayerNorms 4d
#   = 12 d^2 + 13 d = 201_326_592 + 53_248 = 201_379_840
# 32 blocks = 6_444_154_880; word embedding 50304 x 4096 = 206_045_184 (vocab padded 50257 -> 50304);
# positions 4096 x 4096 = 16_777_216; ln_f 2 x 4096 = 8_192.
N_7B = 6_444_154_880 + 206_045_184 + 16_777_216 + 8_192  # = 6_666_985_472

# Per-block activations at micro-batch b=16: sbh = 4096 x 16 x 4096 = 268_435_456 elements.
# LayerNorm inputs+outputs 4 x 2 bytes = 8 sbh, Q K V + attn out + MLP up + GELU out 12 x 2 bytes = 24 sbh
#   -> 32 sbh = 8_589_934_592 bytes; flash log-sum-exp 4 bytes x a s b = 4 x 32 x 4096 x 16 = 8_388_608.
SBH_16 = 268_435_456
LAYER_ACT_16 = 8_589_934_592 + 8_388_608  # = 8_598_323_200
# Last-stage extras at b=16: ln_f input+output 2 x 2 bytes x sbh = 1_073_741_824; logits: 16 x 4096 = 65_536
# tokens x 50_304 = 3_296_722_944 elements, x (2 bf16 + 4 fp32 copy + 4 log-softmax) = 32_967_229_440.
LOGITS_16 = 1_073_741_824 + 32_967_229_440  # = 34_040_971_264


def test_bus_factors_match_nccl_tests():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 4) == 3 / 4
    assert bus_factor("reduce_scatter", 2) == 1 / 2
    assert bus_factor("all_to_all", 8) == 7 / 8
    assert bus_factor("broadcast", 8) == 1
    assert bus_factor("all_reduce", 1) == 0


def test_param_count_matches_model():
    assert param_count(CFG_7B) == N_7B == 6_666_985_472
    tiny = ModelConfig(**MODEL_PRESETS["gpt2-tiny"])
    assert param_count(tiny) == GPT(tiny).num_params()


def test_data_parallel_ddp():
    layout = layout_7b()
    ops = step_communication(layout)
    # One all-reduce of all 16-bit grads: 2 N = 13_333_970_944 bytes; ring moves 2 (n-1)/n = 1.75 x that.
    assert [(op.collective, op.group_size, op.message_bytes, op.calls) for op in ops] == [
        ("all_reduce", 8, 13_333_970_944, 1)]
    assert ops[0].wire_bytes == 23_334_449_152
    # At 100 GB/s bus bandwidth: 23_334_449_152 / 1e11 = 0.233 s.
    assert comm_time(ops, 100e9) == pytest.approx(0.23334449152)

    mem = memory_per_gpu(layout)
    assert mem.params == 13_333_970_944  # 2 N
    assert mem.grads == 13_333_970_944  # 2 N
    assert mem.optimizer == 80_003_825_664  # 12 N
    assert mem.activations == 32 * LAYER_ACT_16 == 275_146_342_400  # 16 sequences per GPU, 32 blocks
    assert mem.logits == LOGITS_16


def test_activation_checkpointing_keeps_block_inputs_plus_one_block():
    mem = memory_per_gpu(layout_7b(activation_checkpointing=True))
    # 32 block inputs x 2 bytes x sbh = 32 x 536_870_912 = 17_179_869_184, plus one recomputed block.
    assert mem.activations == 17_179_869_184 + 8_598_323_200


def test_fsdp_zero3():
    layout = layout_7b(zero_stage=3)
    ops = step_communication(layout)
    # All-gather forward, all-gather backward, reduce-scatter: each of 2 N = 13_333_970_944 bytes,
    # (n-1)/n = 7/8 on the wire: 11_667_224_576 each, 35_001_673_728 in all = 1.5 x the DDP all-reduce.
    assert sorted((op.collective, op.message_bytes, op.calls) for op in ops) == [
        ("all_gather", 13_333_970_944, 1), ("all_gather", 13_333_970_944, 1), ("reduce_scatter", 13_333_970_944, 1)]
    assert sum(op.wire_bytes for op in ops) == 35_001_673_728
    mem = memory_per_gpu(layout)
    assert mem.params == 1_666_746_368  # 2 N / 8
    assert mem.grads == 1_666_746_368
    assert mem.optimizer == 10_000_478_208  # 12 N / 8
    assert mem.activations == 275_146_342_400  # unchanged: same 16 sequences per GPU


def test_tensor_parallel_8():
    layout = layout_7b(tp=8)
    # Per TP rank, per block: (12 d^2 + 7 d) / 8 split (QKV, MLP up with their biases, both output weights)
    #   = (201_326_592 + 28_672) / 8 = 25_169_408, plus 6 d = 24_576 replicated (2 output biases, 2 LNs)
    #   = 25_193_984; x 32 = 806_207_488. Word embedding / 8 = 25_755_648; positions 16_777_216; ln_f 8_192.
    assert local_params(layout) == 806_207_488 + 25_755_648 + 16_777_216 + 8_192  # = 848_748_544
    ops = {op.name: op for op in step_communication(layout)}
    act = ops["activation all-reduce"]
    # [b=128, s=4096, h=4096] x 2 bytes = 4_294_967_296 per all-reduce; 4 per block (2 fwd, 2 bwd) x 32
    # + embedding + LM-head input = 130 calls; x 1.75 = 7_516_192_768 on the wire each,
    # x 130 = 977_105_059_840 bytes.
    assert (act.message_bytes, act.calls, act.wire_bytes) == (4_294_967_296, 130, 977_105_059_840)
    ce = ops["vocab-parallel CE all-reduce"]
    assert (ce.message_bytes, ce.calls) == (128 * 4096 * 4, 3)  # 2_097_152 bytes fp32, max/sum-exp/target
    # At 400 GB/s NVLink bus bandwidth: (977_105_059_840 + 3 x 2_097_152 x 1.75) / 4e11 = 2.4428 s.
    assert comm_time(list(ops.values()), {"tp": 400e9}) == pytest.approx((977_105_059_840 + 11_010_048) / 4e11)

    # Activations per block at b=128: sbh = 2_147_483_648. Replicated LN in/out 8 sbh = 17_179_869_184;
    # split (24 sbh + 4 x 32 x 4096 x 128 lse) / 8 = (51_539_607_552 + 67_108_864) / 8 = 6_450_839_552.
    mem = memory_per_gpu(layout)
    assert mem.activations == 32 * (17_179_869_184 + 6_450_839_552)  # = 756_182_679_552
    # Sequence parallelism splits the replicated part too: (32 sbh + lse) / 8 = 8_598_323_200 per block.
    sp = memory_per_gpu(layout_7b(tp=8, sequence_parallel=True))
    assert sp.activations == 32 * 8_598_323_200
    sp_ops = step_communication(layout_7b(tp=8, sequence_parallel=True))
    # all-gather + reduce-scatter at 7/8 each carry the same bytes as the all-reduce at 2 x 7/8.
    assert sum(op.wire_bytes for op in sp_ops) == sum(op.wire_bytes for op in ops.values())


def test_unfused_attention_reproduces_korthikanti():
    # Paper, 16-bit, with dropout, no TP: s b h (34 + 5 a s / h) bytes per layer.
    cfg = ModelConfig(n_layer=1, n_head=12, n_embd=768, dropout=0.1)
    s, b, h, a = 1024, 8, 768, 12
    expected = s * b * h * 34 + 5 * a * s * s * b
    assert layer_activation_bytes(cfg, b, s, flash=False) == expected
    # With TP t=4, no SP: s b h (10 + 24 / t + 5 a s / (h t)).
    assert layer_activation_bytes(cfg, b, s, tp=4, flash=False) == s * b * h * 10 + (
        s * b * h * 24 + 5 * a * s * s * b) / 4
