"""ParallelDims: the rank grid and its process groups, every layout validation error (gpt2.config.layout), and the
DeepSpeed mpu adapter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpt2.config.layout import check_sequence_split, check_tp_divides_model, check_tp_divides_world
from gpt2.config.schema import MODEL_PRESETS, ConfigError, ModelConfig
from gpt2.model.gpt import GPT
from parallel.dims import ParallelDims
from parallel.mpu import ModelParallelUnit
from parallel.tp_plan import apply_tensor_parallel
from tests._tp_harness import device, spawn


def test_grid_and_coordinates():
    dims = [ParallelDims(world_size=8, rank=r, tp_size=2) for r in range(8)]
    assert dims[0].grid().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [(d.dp_rank, d.tp_rank) for d in dims] == [(r // 2, r % 2) for r in range(8)]
    assert dims[0].dp_size == 4
    assert ParallelDims(world_size=4, rank=3, tp_size=4).grid().tolist() == [[0, 1, 2, 3]]


def test_world_not_divisible_by_tp():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by --tp-size 4"):
        check_tp_divides_world(world_size=6, tp_size=4)
    with pytest.raises(ValueError, match="not a multiple of tp_size 4"):  # the grid itself refuses it too
        ParallelDims(world_size=6, rank=0, tp_size=4)


def test_heads_not_divisible_names_the_fix():
    large = ModelConfig(**MODEL_PRESETS["gpt2-large"])  # 20 heads, d = 1280, vocab padded to 50304
    with pytest.raises(ConfigError) as err:
        check_tp_divides_model(large, tp_size=3)
    msg = str(err.value)
    assert "--tp-size 3 does not divide n_head = 20" in msg
    assert "[1, 2, 4]" in msg  # the sizes dividing 20 heads, 4*1280 and 50304 all at once
    assert "--n-head" in msg
    check_tp_divides_model(large, tp_size=4)


def test_unpadded_vocab_not_divisible_names_the_fix():
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, pad_vocab=False)  # vocab 50257, odd
    with pytest.raises(ConfigError, match=r"padded vocab = 50257.*drop --no-pad-vocab"):
        check_tp_divides_model(cfg, tp_size=2)
    check_tp_divides_model(cfg, tp_size=1)  # no TP: nothing to split


def test_sequence_parallel_needs_divisible_seq_len():
    with pytest.raises(ConfigError, match=r"--seq-len divisible by --tp-size 4, got 30; use --seq-len 28"):
        check_sequence_split(30, tp_size=4, sequence_parallel=True)
    check_sequence_split(30, tp_size=4, sequence_parallel=False)
    check_sequence_split(32, tp_size=4, sequence_parallel=True)


def run_group_checks(dims: ParallelDims) -> None:
    grid = dims.grid()
    assert dist.get_process_group_ranks(dims.tp_group) == grid[dims.dp_rank].tolist()
    assert dist.get_process_group_ranks(dims.dp_group) == grid[:, dims.tp_rank].tolist()
    # the groups carry traffic: a TP-group sum adds the row, a DP-group sum the column
    row, col = torch.tensor(float(dims.rank), device=device()), torch.tensor(float(dims.rank), device=device())
    dist.all_reduce(row, group=dims.tp_group)
    dist.all_reduce(col, group=dims.dp_group)
    assert row.item() == grid[dims.dp_rank].sum().item() and col.item() == grid[:, dims.tp_rank].sum().item()

    mpu = ModelParallelUnit(dims)
    assert mpu.get_model_parallel_group() is mpu.get_tensor_model_parallel_group() is dims.tp_group
    assert mpu.get_data_parallel_group() is dims.dp_group
    assert (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()) == (dims.tp_rank, dims.tp_size)
    assert mpu.get_tensor_model_parallel_rank() == dims.tp_rank
    assert mpu.get_tensor_model_parallel_world_size() == dims.tp_size
    assert (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()) == (dims.dp_rank, dims.dp_size)
    assert mpu.get_data_parallel_group_ranks() == dist.get_process_group_ranks(dims.dp_group)
    assert mpu.get_tensor_model_parallel_src_rank() == dist.get_process_group_ranks(dims.tp_group)[0]
    assert (mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()) == (0, 1)


def test_groups_and_mpu_on_a_2x2_grid():
    spawn(run_group_checks, 4, 2)


def test_tp_needs_groups_first():
    dims = ParallelDims(world_size=2, rank=0, tp_size=2)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, n_positions=8, vocab_size=128))
    with pytest.raises(ValueError, match="build_groups"):
        apply_tensor_parallel(model, dims, sequence_parallel=False, overlap=True)
    with pytest.raises(ValueError, match="build_groups"):
        ModelParallelUnit(dims)
