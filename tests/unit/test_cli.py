"""Bad input fails early, with a message that names the fix, before any model or data work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gpt2.config.cli
import train
from gpt2.config.cli import parse_args
from gpt2.config.layout import RunLayout, check_tp_divides_model, check_tp_divides_world
from gpt2.config.schema import ConfigError, ModelConfig
from tests.train_runs import train_error

ROOT = Path(__file__).resolve().parents[2]


def _error_of(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--mode", "pipeline"], "invalid choice: 'pipeline'"),
        (["--model", "gpt5"], "invalid choice: 'gpt5'"),
        (["--batch-size", "0"], "must be a positive integer"),
        (["--seq-len", "-4"], "must be a positive integer"),
        (["--max-steps", "0"], "must be a positive integer"),
        (["--lr", "0"], "must be > 0"),
        (["--attn", "xformers"], "invalid choice: 'xformers'"),
    ],
)
def test_argparse_rejects(argv: list[str], needle: str, capsys: pytest.CaptureFixture) -> None:
    assert needle in _error_of(argv, capsys)


def _float_flags() -> list[str]:
    """Every flag of train.py whose value parses as a float."""
    from gpt2.config.cli import build_parser

    flags = []
    for action in build_parser()._actions:
        try:
            parsed = action.type("1.5") if callable(action.type) else None
        except (ValueError, TypeError):  # int flags
            continue
        if isinstance(parsed, float):
            flags.append(action.option_strings[0])
    return flags


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_flag_must_be_finite(value: str, capsys: pytest.CaptureFixture) -> None:
    flags = _float_flags()
    assert {"--lr", "--min-lr", "--weight-decay", "--grad-clip", "--dropout", "--busbw-gbs"} <= set(flags)
    for flag in flags:
        assert f"argument {flag}: must be a finite number, got {float(value)}" in _error_of([f"{flag}={value}"], capsys)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "gpt2-tiny", "--seq-len", "512"], "--seq-len 512 exceeds the model's 256 positions"),
        (["--n-embd", "100", "--n-head", "3"], "not divisible by --n-head 3"),
        (["--min-lr", "1", "--lr", "0.1"], "--min-lr must be in [0, --lr 0.1], got 1.0"),
        (["--min-lr", "-0.01"], "--min-lr must be in [0, --lr 0.0006], got -0.01"),
        (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
        (["--seed", "-1"], "--seed must be in [0, 2**32)"),
        (["--seed", str(2**64)], "--seed must be in [0, 2**32)"),
        (["--device", "tpu"], "--device 'tpu' is not a device this harness runs on"),
        (["--run-name", "a/b"], "--run-name 'a/b' must be a plain folder name"),
        (["--run-name", ".."], "must be a plain folder name"),
        (["--zero-stage", "2"], "--zero-stage: DeepSpeed ZeRO settings, used only by --mode hybrid; drop it"),
        (["--mode", "baseline", "--zero-stage", "3", "--zero3-fetch", "module"], "drop them or use --mode hybrid"),
        (["--zero-precision", "deepspeed"], "--zero-precision: DeepSpeed ZeRO settings, used only by --mode hybrid"),
        (["--deepspeed-nvtx"], "--deepspeed-nvtx: DeepSpeed ZeRO settings, used only by --mode hybrid"),
        (["--zero-engine", "deepspeed"], "--zero-engine: DeepSpeed ZeRO settings, used only by --mode hybrid"),
        # --zero-engine fsdp2 (gpt2.engines.fsdp2_engine): what FSDP2 cannot take, before any work
        (["--mode", "baseline", "--zero-engine", "fsdp2"], "--mode baseline shards nothing: use --mode hybrid"),
        (["--mode", "hybrid", "--zero-engine", "fsdp2", "--zero-stage", "1"], "has no FSDP2 equivalent"),
        (["--mode", "hybrid", "--optimizer", "triton"],
         "--optimizer triton steps torch's AdamW state, which DeepSpeed does not keep"),
        (["--mode", "hybrid", "--zero-engine", "fsdp2", "--precision", "fp16"], "use --precision bf16"),
        (["--mode", "hybrid", "--zero-engine", "fsdp2", "--ds-config", "ds_configs/zero3.json"],
         "--ds-config: DeepSpeed settings, which --zero-engine fsdp2 does not read; drop it or use --zero-engine"),
        (["--mode", "hybrid", "--zero-engine", "fsdp2", "--compile", "--compiler", "deepcompile"],
         "--compiler deepcompile: DeepSpeed settings, which --zero-engine fsdp2 does not read"),
        (["--mode", "hybrid", "--zero-engine", "fsdp2", "--zero3-fetch", "block", "--zero-precision", "autocast"],
         "--zero3-fetch / --zero-precision: DeepSpeed settings, which --zero-engine fsdp2 does not read; drop them"),
        (["--mode", "hybrid", "--fsdp2-unit-blocks", "2"], "--fsdp2-unit-blocks: an FSDP2 setting; add --mode "
                                                             "hybrid --zero-engine fsdp2 or drop it"),
        (["--mode", "hybrid", "--fsdp2-forward-prefetch", "2"], "--fsdp2-forward-prefetch: an FSDP2 setting; add "
                                                                  "--mode hybrid --zero-engine fsdp2 or drop it"),
        (["--mode", "hybrid", "--fsdp2-unit-blocks", "2", "--fsdp2-gather", "fp32"],
         "--fsdp2-unit-blocks / --fsdp2-gather: FSDP2 settings; add --mode hybrid --zero-engine fsdp2 or drop them"),
        (["--mode", "hybrid", "--zero-engine", "fsdp2", "--model", "gpt2", "--fsdp2-unit-blocks", "13"],
         "--fsdp2-unit-blocks 13 is more blocks than the model's 12; use 1 to 12"),
        (["--mode", "hybrid", "--model", "gpt2", "--zero3-unit-blocks", "5"],
         "--zero3-unit-blocks 5 does not divide the model's 12 blocks; use one of [1, 2, 3, 4, 6, 12]"),
        (["--mode", "baseline", "--zero3-unit-blocks", "2"], "--zero3-unit-blocks: DeepSpeed ZeRO settings, used "
                                                             "only by --mode hybrid"),
        (["--mode", "hybrid", "--zero3-fetch", "module", "--zero3-unit-blocks", "2"],
         "needs --zero-stage 3 with --zero3-fetch block or flat"),
        (["--mode", "hybrid", "--zero-stage", "2", "--zero3-unit-blocks", "2"], "needs --zero-stage 3"),
        (["--mode", "hybrid", "--zero-engine", "fsdp2", "--zero3-unit-blocks", "2"],
         "--zero3-unit-blocks: DeepSpeed settings, which --zero-engine fsdp2 does not read"),
        (["--mode", "hybrid", "--compile", "--compiler", "deepcompile", "--zero3-unit-blocks", "2"],
         "drop --zero3-fetch and --zero3-unit-blocks"),
        (["--plan", "--search", "--busbw-gbs", "1", "2", "3"], "--busbw-gbs takes one or two values"),
        (["--data", "synthetic", "--data-path", "x"], "drop one of the two"),
        (["--ds-config", "ds_configs/zero3.json"], "--ds-config only applies to --mode hybrid"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
        (["--sequence-parallel"], "--sequence-parallel shards the sequence over the tensor-parallel group"),
        # engine-level limits, caught here rather than after tokenisation and the run folder
        (["--mode", "hybrid", "--compile", "--zero3-fetch", "module"], "--compile with ZeRO-3 needs"),
        (["--mode", "hybrid", "--compile", "--compile-scope", "model"], "--compile-scope model (one graph cut at DDP"),
        (["--mode", "baseline", "--tp-size", "2", "--compile", "--compile-scope", "model"], "--compile-scope blocks"),
        (["--mode", "baseline", "--tp-size", "2", "--precision", "fp16"], "--precision fp16 with --tp-size > 1"),
    ],
)
def test_validate_rejects(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as exc:
        parse_args(argv)
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--world-size", "4"], "--gpus / --world-size 4: the GPU count that --plan plans for"),
        (["--gpus", "2", "--mode", "baseline"], "add --plan or drop it"),
        (["--plan", "--busbw-gbs", "100"], "--busbw-gbs: read only by --plan --search"),
        (["--achievable-tflops", "300"], "--achievable-tflops: read only by --plan --search"),
        (["--compile-scope", "blocks"], "--compile-scope blocks says what --compile compiles; add --compile"),
        (["--compiler", "torch"], "--compiler torch says who compiles under --compile"),
        (["--compile-wrapper", "cpp"], "--compile-wrapper cpp picks the host code of torch.compile's graphs; add "
                                       "--compile"),
        (["--mode", "hybrid", "--compile", "--compiler", "deepcompile", "--compile-wrapper", "python"],
         "DeepCompile builds its own: drop --compile-wrapper or use --compiler torch"),
        (["--ddp-bucket-mb", "25"], "--ddp-bucket-mb sizes DDP's gradient buckets, used only by --mode baseline"),
        (["--mode", "hybrid", "--zero-stage", "2", "--zero3-fetch", "module"], "--zero-stage 2 keeps whole parameters"),
        (["--mode", "hybrid", "--zero-stage", "1", "--zero3-fetch", "block"], "drop it or use --zero-stage 3"),
        (["--no-tp-overlap"], "--tp-size 1 has none"),
        (["--eval-interval", "5", "--eval-batches", "0"], "--eval-batches 0 turns evaluation off; drop one"),
        (["--data", "synthetic", "--tokenizer", "gpt2"], "--tokenizer: --data synthetic draws random token ids"),
        (["--data", "synthetic", "--cache-dir", "c", "--num-proc", "2"], "--cache-dir, --num-proc: --data synthetic"),
        (["--init-from", "gpt2", "--resume", "ck/step-000010"], "loads the checkpoint's over them; drop one"),
    ],
)
def test_a_flag_that_cannot_act_is_an_error_naming_why(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_args(argv)
    assert needle in str(exc.value)


def test_profile_needs_the_steps_it_records(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["--data", "synthetic", "--device", "cpu", "--profile", "--max-steps", "6"]
    err = train_error(args, capsys, tmp_path / "runs")  # 3 warm-up + 1 profiler warm-up + 3 profiled = 7
    assert "--profile records steps 5-7 of a run" in err and "raise --max-steps to 7" in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("var", "value"), [("WORLD_SIZE", "two"), ("WORLD_SIZE", "0"), ("RANK", "-1"),
                                            ("LOCAL_RANK", "x"), ("GPT2_COLLECTIVE_TIMEOUT_MIN", "0")])
def test_a_bad_environment_variable_is_named(var: str, value: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    monkeypatch.setenv(var, value)
    err = train_error(["--data", "synthetic"], capsys, tmp_path / "runs")
    assert f"train.py: error: environment variable {var}={value!r} is not an integer >=" in err, err
    if var == "WORLD_SIZE":  # --plan reads it too
        assert train.main(["--plan"]) == 2 and f"{var}={value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out-dir", "--save-dir"])
def test_an_output_folder_that_cannot_be_written_fails_at_parse_time(flag: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "f").write_text("a user's file")
    with pytest.raises(ConfigError, match=f"{flag} {tmp_path / 'f' / 'ck'} cannot be created: {tmp_path / 'f'} is a "
                                          "file"):
        parse_args([flag, str(tmp_path / "f" / "ck")])
    # read-only for this user (simulated: the tests run as root, who may write anywhere)
    monkeypatch.setattr(gpt2.config.cli.os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(ConfigError, match=f"{flag} {tmp_path / 'new'} is not writable here"):
        parse_args([flag, str(tmp_path / "new")])
    assert parse_args(["--cache-dir", str(tmp_path / "new")])  # a read-only token cache still serves hits


def test_a_name_longer_than_the_file_system_takes_is_refused(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """A run name or an output folder's name past NAME_MAX ended in an ENAMETOOLONG traceback at make_run_dir."""
    err = train_error(["--model", "gpt2-tiny", "--data", "synthetic", "--max-steps", "1", "--run-name", "r" * 300],
                      capsys, tmp_path / "runs")
    assert err.count("\n") == 1 and "--run-name is 300 bytes long; at most 251 here" in err, err
    with pytest.raises(ConfigError, match="is longer than the file system's 255 bytes; pass a shorter path"):
        parse_args(["--save-dir", str(tmp_path / ("c" * 256) / "ck")])
    assert parse_args(["--run-name", "r" * 251, "--out-dir", str(tmp_path)]).log.run_name == "r" * 251


def test_validate_accepts_the_supported_neighbours() -> None:
    assert parse_args(["--mode", "hybrid", "--zero-stage", "2", "--compile"]).parallel.zero_stage == 2
    assert parse_args(["--mode", "hybrid"]).parallel.zero_stage == 3  # the default
    assert [parse_args(["--mode", "hybrid", *f]).parallel.deepspeed_nvtx for f in ([], ["--deepspeed-nvtx"])] == [
        False, True]
    parse_args(["--device", "cuda:1", "--seed", "0", "--min-lr", "0"])
    parse_args(["--mode", "hybrid", "--compile"])  # ZeRO-3 over flat block units (the default --zero3-fetch)
    fsdp2 = parse_args(["--mode", "hybrid", "--zero-engine", "fsdp2", "--zero-stage", "2", "--tp-size", "2",
                        "--compile"])
    assert (fsdp2.zero_engine, fsdp2.zero_stage, parse_args(["--mode", "hybrid"]).zero_engine) == (
        "fsdp2", 2, "deepspeed")
    parse_args(["--mode", "hybrid", "--tp-size", "2", "--precision", "fp16"])  # DeepSpeed's scaler syncs over TP
    parse_args(["--mode", "baseline", "--tp-size", "2", "--precision", "bf16"])
    assert parse_args([]).train.attn == "sdpa"  # the default
    assert [parse_args(["--attn", a]).train.attn for a in ("auto", "sdpa-cudnn")] == ["auto", "sdpa-cudnn"]


def test_settings_that_run_but_surprise_are_warned_about_once_in_the_layout() -> None:
    """RunLayout.warnings (the loop only logs them): a run of only warm-up steps (a resumed one counts from its start
    step), dropout under TP, an LR warm-up longer than the run; a plain run has none."""
    def warnings(flags: list[str], start_step: int = 0, world_size: int = 1) -> list[str]:
        return RunLayout.resolve(parse_args(flags), world_size, "cpu").warnings(start_step)

    assert warnings(["--max-steps", "10"]) == []
    assert warnings(["--max-steps", "3", "--warmup-steps", "1"]) == [
        "all 3 steps are throughput warm-up: no tokens/s or MFU; raise --max-steps above 3"]
    assert warnings(["--max-steps", "10"], start_step=8)[0].startswith("all 2 steps are throughput warm-up")
    assert "or profiled (4 after --throughput-warmup-steps)" in warnings(["--max-steps", "7", "--profile"])[0]
    assert "dropout masks repeat" in warnings(["--mode", "baseline", "--tp-size", "2", "--dropout", "0.1"],
                                              world_size=2)[0]
    assert warnings(["--warmup-steps", "20", "--max-steps", "10"]) == [
        "--warmup-steps 20 exceeds --max-steps 10: the LR never reaches --lr 0.0006"]


@pytest.mark.parametrize(("flags", "device", "cpp"), [
    (["--mode", "hybrid", "--compile"], "cuda", True),  # auto: C++ for per-block graphs on CUDA (host-bound)
    (["--mode", "hybrid", "--zero-engine", "fsdp2", "--compile"], "cuda", True),
    (["--mode", "hybrid", "--compile"], "cpu", False),  # auto: Python on CPU
    (["--compile"], "cuda", False),  # single's whole-model graph: no gain measured
    (["--compile", "--compile-scope", "blocks"], "cuda", False),  # single's per-block graphs: not run with it
    (["--mode", "hybrid", "--compile", "--tp-size", "2"], "cuda", True),  # TP's all-reduces in the graphs
    (["--mode", "hybrid", "--zero-engine", "fsdp2", "--compile", "--tp-size", "2"], "cuda", True),
    (["--mode", "hybrid", "--compile", "--tp-size", "2", "--sequence-parallel"], "cuda", False),  # not run with SP
    (["--mode", "baseline", "--compile", "--tp-size", "2"], "cuda", False),  # DDP + TP: not run with it
    (["--mode", "hybrid", "--compile", "--fused-kernels", "triton"], "cuda", False),  # nor with Triton kernels
    (["--mode", "hybrid", "--compile", "--fused-kernels", "cuda"], "cuda", True),  # cuda's custom op: measured
    (["--mode", "hybrid", "--compile", "--fused-kernels", "cuda", "--zero3-fetch", "flat"], "cuda", True),
    (["--mode", "hybrid", "--compile", "--fused-kernels", "cuda", "--tp-size", "2"], "cuda", False),  # not with TP
    (["--mode", "hybrid", "--zero-engine", "fsdp2", "--compile", "--fused-kernels", "cuda"], "cuda", False),
    (["--compile", "--compile-wrapper", "cpp"], "cpu", True),
    (["--mode", "hybrid", "--zero-stage", "2", "--compile"], "cuda", False),  # ZeRO-2's graphs: not run with it
    (["--mode", "hybrid", "--zero-engine", "fsdp2", "--zero-stage", "2", "--compile"], "cuda", False),
    (["--mode", "hybrid", "--compile", "--compile-wrapper", "python"], "cuda", False),
    ([], "cuda", False),  # nothing compiled
])
def test_the_compile_wrapper_is_cpp_where_it_was_measured_unless_asked(flags: list[str], device: str,
                                                                       cpp: bool) -> None:
    world = 2 if "--tp-size" in flags else 1
    assert RunLayout.resolve(parse_args(flags), world_size=world, device=device).inductor_cpp_wrapper is cpp


@pytest.mark.parametrize("flags, fetch, unit", [
    (["--model", "gpt2"], "flat", 4),  # the default: flat tensors, 4 blocks a unit
    (["--model", "gpt2-large"], "flat", 4),
    (["--model", "gpt2-tiny"], "flat", 2),  # 2 blocks: the largest divisor up to 4
    (["--model", "gpt2", "--n-layer", "6"], "flat", 3),
    (["--model", "gpt2", "--n-layer", "5"], "flat", 1),
    (["--model", "gpt2", "--zero3-fetch", "block"], "block", 4),
    (["--model", "gpt2", "--zero3-unit-blocks", "6"], "flat", 6),  # given: kept
    (["--model", "gpt2", "--zero3-fetch", "module"], "module", 1),  # no leaf blocks
    (["--model", "gpt2", "--zero-stage", "2"], None, 1),
])
def test_the_zero3_gather_defaults_to_flat_units_of_4(flags: list[str], fetch: str | None, unit: int) -> None:
    layout = RunLayout.resolve(parse_args(["--mode", "hybrid", *flags]), 2, "cpu")
    assert (layout.zero3_fetch, layout.zero3_unit_blocks) == (fetch, unit)


@pytest.mark.parametrize("flags, unit", [
    (["--model", "gpt2"], 4),  # the default
    (["--model", "gpt2-tiny"], 2),  # capped at the model's depth
    (["--model", "gpt2", "--n-layer", "6"], 3),  # flat tensors (the default): the largest divisor up to 4
    (["--model", "gpt2", "--n-layer", "6", "--fsdp2-params", "tensors"], 4),  # its own tensors: a short last unit
    (["--model", "gpt2", "--fsdp2-unit-blocks", "3"], 3),  # given: kept
])
def test_the_fsdp2_unit_defaults_to_4_blocks(flags: list[str], unit: int) -> None:
    layout = RunLayout.resolve(parse_args(["--mode", "hybrid", "--zero-engine", "fsdp2", *flags]), 2, "cpu")
    assert layout.fsdp2_unit_blocks == unit


def test_flat_fsdp2_units_must_divide_the_blocks() -> None:
    fsdp2 = ["--mode", "hybrid", "--zero-engine", "fsdp2", "--model", "gpt2", "--fsdp2-unit-blocks", "5"]
    with pytest.raises(ConfigError, match=re.escape("--fsdp2-params flat needs units of one size, and 5-block units "
                                                    "do not divide the model's 12 blocks; pass --fsdp2-unit-blocks "
                                                    "with one of [1, 2, 3, 4, 6, 12], or --fsdp2-params tensors")):
        parse_args(fsdp2)
    assert RunLayout.resolve(parse_args(fsdp2 + ["--fsdp2-params", "tensors"]), 2, "cpu").fsdp2_unit_blocks == 5


@pytest.mark.parametrize("flags, device, gathered", [
    ([], "cuda", torch.bfloat16),  # auto: bf16 for a bf16 run without fused kernels
    (["--tp-size", "2"], "cuda", torch.bfloat16),
    (["--fused-kernels", "triton"], "cuda", None),  # auto: not measured with fused kernels
    (["--fused-kernels", "triton", "--fsdp2-gather", "bf16"], "cuda", torch.bfloat16),
    (["--fsdp2-gather", "fp32"], "cuda", None),
    (["--precision", "fp32"], "cuda", None),  # nothing to round to
    (["--fsdp2-gather", "bf16"], "cpu", None),  # CPU runs are fp32
])
def test_fsdp2_gathers_bf16_where_it_was_measured_unless_asked(flags: list[str], device: str,
                                                               gathered: torch.dtype | None) -> None:
    argv = ["--mode", "hybrid", "--zero-engine", "fsdp2", *flags]
    assert RunLayout.resolve(parse_args(argv), world_size=2, device=device).fsdp2_gather_dtype is gathered


@pytest.mark.parametrize("flags, optimizer", [
    ([], "torch"),
    (["--fused-kernels", "triton"], "triton"),  # auto: the set's AdamW where torch's state is stepped
    (["--fused-kernels", "triton", "--mode", "baseline"], "triton"),
    (["--fused-kernels", "triton", "--mode", "hybrid", "--zero-engine", "fsdp2"], "triton"),
    (["--fused-kernels", "triton", "--mode", "hybrid"], "torch"),  # DeepSpeed steps its own partitions
    (["--fused-kernels", "cuda"], "triton"),  # either fused set steps with it
    (["--use-fused-kernel"], "triton"),
    (["--fused-kernels", "cuda", "--mode", "hybrid"], "torch"),
    (["--fused-kernels", "triton", "--optimizer", "torch"], "torch"),
    (["--optimizer", "triton"], "triton"),
])
def test_the_optimizer_is_resolved_in_the_config(flags: list[str], optimizer: str) -> None:
    """config.json names the AdamW a run stepped with (the parity key reads it), never `auto`."""
    assert parse_args(flags).train.optimizer == optimizer


def test_only_fsdp2_has_a_gather_dtype() -> None:
    assert RunLayout.resolve(parse_args(["--mode", "hybrid"]), 2, "cuda").fsdp2_gather is None  # DeepSpeed


def test_global_batch_must_divide() -> None:
    cfg = parse_args(["--mode", "baseline", "--batch-size", "8", "--global-batch-size", "20"])
    with pytest.raises(ConfigError, match="not divisible by --batch-size 8 x dp-size 2 = 16; use a multiple of 16"):
        RunLayout.resolve(cfg, world_size=2, device="cpu")
    cfg = parse_args(["--mode", "baseline", "--batch-size", "8", "--global-batch-size", "64"])
    assert RunLayout.resolve(cfg, world_size=2, device="cpu").grad_accum == 4
    assert cfg.train.grad_accum == 1  # the parsed config is not mutated


def test_single_mode_on_many_processes_is_rejected() -> None:
    with pytest.raises(ConfigError, match="use --mode baseline"):
        RunLayout.resolve(parse_args([]), world_size=4, device="cpu")


def test_tp_size_must_divide_heads_and_names_the_fix() -> None:
    large = ModelConfig(n_layer=36, n_head=20, n_embd=1280)
    fix = r"--tp-size 3 does not divide n_head = 20; choose --tp-size from \[1, 2, 4\]"
    with pytest.raises(ConfigError, match=fix):
        check_tp_divides_model(large, tp_size=3)
    with pytest.raises(ConfigError, match=r"world size 4 is not divisible by --tp-size 3; choose --tp-size from "
                                          r"\[1, 2, 4\]"):
        check_tp_divides_world(world_size=4, tp_size=3)
    with pytest.raises(ConfigError, match=r"choose --tp-size from \[1, 2, 4\]"):
        RunLayout.resolve(parse_args(["--mode", "baseline", "--tp-size", "3"]), world_size=4, device="cpu")


def test_ddp_without_launcher_fails_fast(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert train.main(["--mode", "baseline", "--data", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc_per_node=N train.py --mode baseline" in err


def test_missing_data_path_fails_before_model_build(tmp_path: Path) -> None:
    """A subprocess, timed: the error arrives in seconds and no run folder is left behind."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--data-path", str(tmp_path / "nope"), "--tokenizer",
         str(tmp_path / "tok.json"), "--out-dir", str(tmp_path / "runs"), "--wandb", "disabled"],
        capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr
    assert str(tmp_path / "nope") in proc.stderr
    assert elapsed < 60
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize(("flags", "needle"), [
    (["--fused-kernels", "cuda"], "--fused-kernels cuda needs a CUDA GPU"),
    (["--attn", "flash"], "--attn flash needs the flash-attn package"),
    (["--attn", "sdpa-cudnn"], "--attn sdpa-cudnn needs a CUDA GPU"),
    (["--attn", "sdpa-efficient", "--device", "cpu"], "--attn sdpa-efficient needs a CUDA GPU"),
])
def test_unusable_backend_fails_before_data_and_run_folder(
    flags: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    if "CUDA GPU" in needle:
        monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails even where flash-attn is installed
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "runs"
    assert train.main(flags + ["--data-path", str(tmp_path / "missing"), "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "missing" not in err  # the backend is checked before the data
    assert not out.exists()


def test_init_from_mismatch_fails_before_data_and_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from transformers import GPT2Config

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    hf = tmp_path / "hf"
    GPT2Config(n_layer=3, n_head=4, n_embd=64, n_positions=256).save_pretrained(hf)  # gpt2-tiny has 2 layers
    out = tmp_path / "runs"
    flags = ["--data-path", str(tmp_path / "missing"), "--out-dir", str(out)]
    assert train.main(["--init-from", str(hf)] + flags) == 2
    err = capsys.readouterr().err
    assert "n_layer 3" in err and "--n-layer 3" in err and "missing" not in err
    assert train.main(["--init-from", str(tmp_path / "nope")] + flags) == 2
    err = capsys.readouterr().err
    assert "neither a hub name" in err and "missing" not in err
    assert not out.exists()


def test_init_from_a_folder_that_is_not_a_gpt2_export_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    """Not the architecture advice transformers' defaults would give (an empty folder read as GPT-2 small)."""
    from transformers import BertConfig, GPT2Config

    flags = ["--data-path", str(tmp_path / "missing"), "--init-from"]
    (tmp_path / "empty").mkdir()
    err = train_error(flags + [str(tmp_path / "empty")], capsys, tmp_path / "runs")
    assert "is not a Hugging Face GPT-2 folder: it has no config.json" in err and "--model" not in err, err
    BertConfig().save_pretrained(tmp_path / "bert")
    assert "holds a 'bert' model, not GPT-2" in train_error(flags + [str(tmp_path / "bert")], capsys, tmp_path / "runs")
    GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=256).save_pretrained(tmp_path / "config-only")  # gpt2-tiny
    err = train_error(flags + [str(tmp_path / "config-only")], capsys, tmp_path / "runs")
    assert "has a GPT-2 config.json but no weights (model.safetensors" in err, err
    assert not (tmp_path / "runs").exists()


def test_stale_launcher_variables_are_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                            tmp_path: Path) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = train_error(["--data", "synthetic"], capsys, tmp_path / "runs")
    assert "the environment has WORLD_SIZE=2 but no RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in err, err
    assert "launched on" not in err


def _launched(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int, port: int) -> None:
    """Launcher variables as torchrun would set them, without its agent store; a rendezvous fails the test at once
    (the old code waited there for the collective timeout)."""
    for var, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", 0), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", port)):
        monkeypatch.setenv(var, str(value))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("rendezvous reached"))


def test_launcher_values_that_cannot_launch_are_refused_before_the_rendezvous(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _launched(monkeypatch, rank=2, world_size=2, port=port)
        err = train_error(["--mode", "baseline", "--data", "synthetic"], capsys, tmp_path / "runs")
        assert err.count("\n") == 1 and "RANK=2 is not below WORLD_SIZE=2" in err, err
        _launched(monkeypatch, rank=0, world_size=2, port=port)
        err = train_error(["--mode", "baseline", "--data", "synthetic"], capsys, tmp_path / "runs")
        assert err.count("\n") == 1 and f"MASTER_PORT={port} is already in use" in err, err


@pytest.mark.parametrize(("device", "flags", "then"), [
    ("cpu", ["--precision", "bf16"], "then rerun (no --save-dir: nothing was saved)"),  # a CPU run is fp32 anyway
    ("cuda", ["--save-dir", "ck"], "then resume from the newest checkpoint (--resume auto)"),
])
def test_non_finite_advice_names_only_what_this_run_can_change(device: str, flags: list[str], then: str) -> None:
    import torch

    from gpt2.engines.guard import NonFiniteGuard

    layout = RunLayout.resolve(parse_args(flags), world_size=1, device=device)
    advice = NonFiniteGuard.for_run(layout, torch.device("cpu")).advice
    assert ("--precision" in advice) is (device == "cuda") and advice.endswith(then), advice


def test_grad_accum_and_global_batch_size_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="drop --grad-accum 2 or --global-batch-size 64"):
        parse_args(["--grad-accum", "2", "--global-batch-size", "64"])
    assert parse_args([]).train.grad_accum == 1


@pytest.mark.parametrize("flag", ["--out-dir", "--save-dir", "--cache-dir"])
def test_a_file_where_a_folder_goes_is_rejected_at_parse_time(flag: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("a user's file")
    with pytest.raises(ConfigError, match=f"{flag} {tmp_path / 'f'} is a file, not a folder"):
        parse_args([flag, str(tmp_path / "f")])


def _launched_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a one-process torchrun launch (train.main then creates a gloo group in-process)."""
    from tools.common import free_port

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(var, value)


@pytest.mark.parametrize(("ds_config", "needle"), [
    ("{ not json", "is not valid JSON"),
    ('{"zero_optimization": {"stage": 2}}', "sets zero_optimization.stage=2 but --zero-stage is 3"),
    (None, "does not exist"),
])
def test_bad_ds_config_fails_before_data_and_run_folder(
    ds_config: str | None, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import torch.distributed as dist

    _launched_alone(monkeypatch)
    path = tmp_path / "ds.json"
    if ds_config is not None:
        path.write_text(ds_config)
    out = tmp_path / "runs"
    argv = ["--mode", "hybrid", "--device", "cpu", "--ds-config", str(path), "--data-path", str(tmp_path / "missing"),
            "--out-dir", str(out)]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "missing" not in err
    assert not out.exists()
    assert not dist.is_initialized()  # the early error also tore the process group down


def test_wandb_online_without_credentials_fails_before_data_and_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    out = tmp_path / "runs"
    flags = ["--wandb", "online", "--data-path", str(tmp_path / "missing"), "--out-dir", str(out)]
    assert train.main(flags) == 2
    err = capsys.readouterr().err
    assert "--wandb online needs credentials" in err and "run `wandb login`" in err and "missing" not in err
    assert f"{tmp_path / 'netrc'} does not exist" in err
    assert not out.exists()
    # the host's name elsewhere in the file is no credential (the old substring test accepted this file)
    (tmp_path / "netrc").write_text("# api.wandb.ai\nmachine api.wandb.ai.example.org\n  login user\n  password x\n")
    assert train.main(flags) == 2
    assert "has no `machine api.wandb.ai` entry" in capsys.readouterr().err
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    assert train.main(flags) == 2  # credentials found: now it gets as far as the data
    assert "missing" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "why"), [
    (None, "does not exist"),
    ("machine api.wandb.ai\n  login user\n", "entry of .* has no password"),
    ("machine api.wandb.ai login user password k junk\n", "cannot be read as a netrc file .*junk"),
    ("machine other.example.org login user password k\n# api.wandb.ai\n", "no `machine api.wandb.ai` entry"),
    ("machine api.wandb.ai login user password k\n", None),
    ("default login user password k\n", None),
])
def test_wandb_credentials_say_exactly_what_was_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      text: str | None, why: str | None) -> None:
    from gpt2.observe.run_logging import wandb_credentials

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    if text is not None:
        (tmp_path / "netrc").write_text(text)
    source, reason = wandb_credentials()
    if why is None:
        assert source is not None and str(tmp_path / "netrc") in source and reason == ""
    else:
        assert source is None and re.search(why, reason), reason
    monkeypatch.setenv("WANDB_API_KEY", " ")
    assert wandb_credentials()[0] is None or why is None  # a blank key is no key
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_credentials() == ("WANDB_API_KEY", "")


def test_wandb_follows_wandb_mode_and_a_machine_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU image without wandb ran train.py's default into `ModuleNotFoundError: wandb` after a minute of GPU
    work; now the default logs to metrics.jsonl only there, and an explicit choice fails at start-up."""
    import importlib.util

    from gpt2.config.schema import ConfigError
    from gpt2.observe.run_logging import wandb_mode

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(None) == "disabled" and wandb_mode("offline") == "offline"
    monkeypatch.delenv("WANDB_MODE")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    assert wandb_mode(None) == "disabled"
    for requested in ("online", "offline"):
        with pytest.raises(ConfigError, match=f"--wandb {requested} needs the wandb package: pip install wandb"):
            wandb_mode(requested)
