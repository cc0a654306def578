"""DeepSpeed ZeRO (--mode hybrid) on 2 CPU processes (gloo, DS_ACCELERATOR=cpu) against --mode single.

Same seed and global batch (single: batch 4; ZeRO: 2 ranks x batch 2, or x batch 1 x accum 2), fp32.
The single reference is this module's own (`ARGS`, the default lr on uniform synthetic tokens), not the session's
(tests/conftest.py): at that one's lr 3e-3 on 8 repeated blocks DeepSpeed's gradient norm drifts up to 2.5e-4
from single's by step 9 (measured; any lr from 2e-3 up: 2.6e-4), over the 2e-4 that holds here.
Tolerances (measured on CPU in brackets): ZeRO-1/2/3 vs single per-step loss <= 1e-5 relative, only the
reduction order differs [9e-8], and pre-clip gradient norm <= 2e-4 relative [4.2e-5] (the norm catches a 2x
gradient-scale error, e.g. a lost 1/grad-accum, which the losses alone do not: AdamW and clipping hide it);
first-step loss within 1e-5, i.e. a few fp32 ulps: the same initial weights, built whole or under zero.Init (other
weights would differ by ~1e-2) [1 ulp, 9.5e-7]; ZeRO-1/2/3 resume vs uninterrupted <= 1e-6 absolute, loss and
gradient norm [identical]; exported ZeRO-3 weights vs single's after 10 steps <= 1e-4 [2.5e-6].
"""

from __future__ import annotations

import importlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from gpt2.config.cli import parse_args
from gpt2.config.deepspeed_file import build_ds_config as build_layout_ds_config
from gpt2.config.layout import RunLayout
from gpt2.config.schema import ConfigError, RunConfig
from tests.train_runs import (
    REFERENCE_STEPS,
    TINY_ARGS,
    ReferenceRun,
    assert_hf_export_matches,
    assert_matches_reference,
    assert_resume_exact,
    by_collective,
    first_batch_loss,
    read_records,
    run_train,
    step_losses,
    summary,
    train_reference,
)
from tools.parity_matrix import PER_BLOCK

pytestmark = pytest.mark.slow
ARGS = TINY_ARGS + ["--data", "synthetic", "--max-steps", str(REFERENCE_STEPS), "--seed", "3", "--eval-batches", "2"]
GRAD_NORM_REL_TOL = 2e-4  # [4.2e-5]: DeepSpeed sums the squares per shard, in another order than single


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory) -> ReferenceRun:
    """This module's reference (see above): --mode single, batch 4, ARGS."""
    return train_reference(tmp_path_factory.mktemp("zero-reference"), ARGS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """ZeRO-3 (the default gather: flat tensors in units of gpt2-tiny's 2 blocks) with accumulation + checkpoints +
    --comm-log, ZeRO-3 resumed from step 5."""
    root = tmp_path_factory.mktemp("zero")
    zero3 = ARGS + ["--mode", "hybrid", "--batch-size", "1", "--grad-accum", "2"]
    run_train(zero3 + ["--run-name", "zero3", "--save-dir", str(root / "ck-zero3"), "--save-interval", "5",
                       "--comm-log"], root, nproc=2)
    run_train(zero3 + ["--run-name", "zero3-resumed", "--resume", str(root / "ck-zero3" / "step-000005")], root,
              nproc=2)
    return root


def test_zero3_matches_single(single_reference: ReferenceRun, runs: Path) -> None:
    single, zero3 = step_losses(single_reference.run_dir), step_losses(runs / "zero3")
    assert_matches_reference(single_reference, runs / "zero3", GRAD_NORM_REL_TOL)
    assert abs(zero3[0] - math.log(50257)) < 0.1  # GPT-2 init survived the partitioning
    assert abs(zero3[0] - single[0]) < 1e-5  # same initial weights as the plain build
    s = summary(runs / "zero3")
    assert (s["mode"], s["world_size"], s["dp_size"], s["grad_accum"]) == ("hybrid", 2, 2, 2)
    assert s["mem/peak_allocated_gib"] > 0 and s["val_loss"] is not None
    # fp32 weights: DeepSpeed's optimizer updates them in place instead of a cloned fp32 master (the training above
    # matching single's is the proof that sharing is correct;
    # gpt2.engines.deepspeed_engine.zero3_master_shares_fp32_weights)
    shared = re.search(r"ZeRO-3: the fp32 master shares (\d+) of (\d+) weight partitions",
                       (runs / "zero3" / "console.log").read_text())
    assert shared and shared[1] == shared[2] != "0"  # every group: with and without weight decay


def test_zero3_comm_log_bytes_are_the_plan(runs: Path) -> None:
    """--comm-log on 2 ranks (dp 2), batch 1 x accum 2: DeepSpeed's comms logger against the planner, per step after
    the first (DeepSpeed records its parameter trace in step 1 and gathers every use separately there: measured on
    CPU, 4x the tied embedding + 3x the persistent parameters, ~4x steady state).

    Steady state: the reduce-scatter carries every gradient once per micro-step; the all-gathers carry the
    partitioned weights in every micro-step's forward. Partitions are padded to a multiple of dp, and gpt2-tiny's
    embedding (50304 x 64) needs no padding, so the counts agree exactly; the tolerance (0.1%) leaves room only for
    that padding with other shapes. all_reduce / broadcast (overflow and norm scalars, a few hundred bytes) are not
    predicted."""
    s = summary(runs / "zero3")
    predicted = by_collective(s, "plan/dp_payload_bytes/")
    measured = by_collective(s, "plan/measured_dp_payload_bytes/")
    assert set(predicted) == {"all_gather", "reduce_scatter"}, predicted
    for kind, want in predicted.items():
        assert measured[kind] == pytest.approx(want, rel=1e-3), (kind, measured, predicted)
    assert sum(v for k, v in measured.items() if k not in predicted) < 4096  # scalars only


@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_zero2_match_single_and_resume_exactly(single_reference: ReferenceRun, runs: Path, stage: int) -> None:
    args = ARGS + ["--mode", "hybrid", "--zero-stage", str(stage), "--batch-size", "2"]
    ck = runs / f"ck-zero{stage}"
    run_train(args + ["--run-name", f"zero{stage}", "--save-dir", str(ck), "--save-interval", "5"], runs, nproc=2)
    assert_matches_reference(single_reference, runs / f"zero{stage}", GRAD_NORM_REL_TOL)
    run_train(args + ["--run-name", f"zero{stage}-resumed", "--resume", str(ck / "step-000005")], runs, nproc=2)
    assert_resume_exact(runs / f"zero{stage}", runs / f"zero{stage}-resumed", at=5)


@pytest.mark.parametrize(("name", "flags"), [("zero3-module", ["--zero3-fetch", "module"]),
                                             ("zero3-block", list(PER_BLOCK)),
                                             ("zero3-compile", ["--compile"])])
def test_zero3_fetch_unit_and_compile_match_single(single_reference: ReferenceRun, runs: Path, name: str,
                                                   flags: list[str]) -> None:
    """The default (the fixture's run: flat tensors in units of gpt2-tiny's 2 blocks, one DeepSpeed leaf module a
    unit), DeepSpeed's per-module hooks, each block's own parameters one block a leaf under zero.Init (the default
    until 2026-11-29), and the default under --compile (one graph a unit inside its hooks) train the same
    function."""
    unit_line = "ZeRO-3 gathers parameters per unit of 2 transformer blocks (1 DeepSpeed leaf modules)"
    assert unit_line in (runs / "zero3" / "console.log").read_text()
    run_train(ARGS + ["--mode", "hybrid", "--batch-size", "2", "--run-name", name] + flags, runs, nproc=2)
    assert_matches_reference(single_reference, runs / name, GRAD_NORM_REL_TOL)
    console = (runs / name / "console.log").read_text()
    assert (unit_line in console) == (name == "zero3-compile")
    assert ("ZeRO-3 gathers parameters per transformer block (2 DeepSpeed leaf modules)" in console) == (
        name == "zero3-block")
    assert (summary(runs / name).get("zero3_fetch"), summary(runs / name).get("zero3_unit_blocks")) == {
        "zero3-module": ("module", None), "zero3-block": ("block", 1), "zero3-compile": ("flat", 2)}[name]


def test_zero3_resume_is_exact(runs: Path) -> None:
    assert_resume_exact(runs / "zero3", runs / "zero3-resumed", at=5)
    config = json.loads((runs / "zero3-resumed" / "config.json").read_text())
    assert config["checkpoint"]["resumed_from"] == str((runs / "ck-zero3" / "step-000005").resolve())


def test_zero3_checkpoint_exports_and_inits(single_reference: ReferenceRun, runs: Path, tmp_path: Path) -> None:
    """ZeRO-3 shards -> one fp32 state dict (zero_to_fp32) -> HF folder whose logits equal our model's,
    and which --init-from loads under ZeRO-3 as under single."""

    from gpt2.train.export import consolidated_state_dict, export_hf

    cfg, zero_sd = consolidated_state_dict(runs / "ck-zero3" / "step-000010")
    _, single_sd = consolidated_state_dict(single_reference.checkpoint)
    assert set(zero_sd) == set(single_sd)
    for name, tensor in single_sd.items():
        assert torch.allclose(zero_sd[name], tensor, atol=1e-4, rtol=0), name
    export_hf(runs / "ck-zero3", tmp_path / "hf")  # the save dir: its latest checkpoint
    ours, _ = assert_hf_export_matches(cfg, zero_sd, tmp_path / "hf")

    # --init-from under zero.Init (per block: rank 0 loads, each parameter re-partitioned): its first loss is the
    # exported model's on that batch (single's --init-from: tests/integration/test_checkpoint.py)
    args = ARGS + ["--max-steps", "1", "--init-from", str(tmp_path / "hf")]
    run_train(args + ["--mode", "hybrid", *PER_BLOCK, "--batch-size", "2", "--run-name", "init-zero3"], tmp_path,
              nproc=2)
    a, (b,) = first_batch_loss(ours, ARGS + ["--batch-size", "4"]), step_losses(tmp_path / "init-zero3")
    assert abs(a - b) <= 1e-5 and abs(a - step_losses(single_reference.run_dir)[0]) > 1e-3  # trained weights


@pytest.mark.parametrize(("name", "flags", "tensors"), [
    ("zero3-flat", ["--batch-size", "1", "--grad-accum", "2"],
     "3 tensors a transformer block (other.no_decay, matmul.decay, matmul.no_decay)"),
    ("zero3-flat-tp2", ["--batch-size", "4", "--tp-size", "2"],
     "4 tensors a transformer block (other.no_decay, matmul.decay_tp, matmul.no_decay_tp, matmul.no_decay)")])
def test_zero3_flat_block_params_match_single_and_export(single_reference: ReferenceRun, tmp_path: Path, name: str,
                                                          flags: list[str], tensors: str) -> None:
    """--zero3-fetch flat (each block's parameters in a few flat tensors, gpt2.runtime.flat_blocks) on 2 ranks, over
    DP 2 with accumulation and over TP 2 (the plan's marks split the groups): single's function, and the checkpoint
    exports single's weights under our names (the flat layout beside DeepSpeed's files, each TP rank's flat tensors
    split back, then the TP shards joined); over DP, a resume from step 5 continues it exactly."""
    from gpt2.train.export import consolidated_state_dict

    ck = tmp_path / "ck"
    args = ARGS + ["--mode", "hybrid", "--zero3-fetch", "flat", "--zero3-unit-blocks", "1", *flags]
    run_train(args + ["--run-name", name, "--save-dir", str(ck), "--save-interval", "5"], tmp_path, nproc=2)
    assert_matches_reference(single_reference, tmp_path / name, GRAD_NORM_REL_TOL)
    if name == "zero3-flat":
        run_train(args + ["--run-name", "resumed", "--resume", str(ck / "step-000005")], tmp_path, nproc=2)
        assert_resume_exact(tmp_path / name, tmp_path / "resumed", at=5)
    assert f"ZeRO-3 flat parameters: {tensors}" in (tmp_path / name / "console.log").read_text()
    _, flat_sd = consolidated_state_dict(ck / "step-000010")
    _, single_sd = consolidated_state_dict(single_reference.checkpoint)
    assert set(flat_sd) == set(single_sd)
    for key, tensor in single_sd.items():
        assert torch.allclose(flat_sd[key], tensor, atol=1e-4, rtol=0), key


@pytest.mark.parametrize(("fetch", "flags"), [("block", ["--batch-size", "1", "--grad-accum", "2"]),
                                              ("flat", ["--batch-size", "4", "--tp-size", "2", "--sequence-parallel",
                                                        "--compile"])])
def test_zero3_unit_blocks_match_single_resume_and_export(single_reference: ReferenceRun, tmp_path: Path, fetch: str,
                                                          flags: list[str]) -> None:
    """--zero3-unit-blocks 2 (gpt2-tiny's 2 blocks as one DeepSpeed leaf module, gpt2.runtime.block_units) on 2
    ranks: single's function, per-block over DP 2 with accumulation (a resume from step 5 continues it exactly, and a
    resume at another unit size is refused naming both) and flat over TP 2 with sequence parallelism under --compile
    (one graph and one flat tensor set a unit, the groups split by the TP plan's marks); the checkpoint exports
    single's weights under the blocks' own names (the TP shards joined after the units are ungrouped)."""
    from gpt2.train.checkpoint import CheckpointError, check_compatible, read_meta
    from gpt2.train.export import consolidated_state_dict

    ck, name = tmp_path / "ck", f"zero3-{fetch}-unit2"
    args = ARGS + ["--mode", "hybrid", "--zero3-fetch", fetch, "--zero3-unit-blocks", "2", *flags]
    run_train(args + ["--run-name", name, "--save-dir", str(ck), "--save-interval", "5"], tmp_path, nproc=2)
    assert_matches_reference(single_reference, tmp_path / name, GRAD_NORM_REL_TOL)
    console = (tmp_path / name / "console.log").read_text()
    assert "ZeRO-3 gathers parameters per unit of 2 transformer blocks (1 DeepSpeed leaf modules)" in console
    assert summary(tmp_path / name)["zero3_unit_blocks"] == 2
    if fetch == "block":
        run_train(args + ["--run-name", "resumed", "--resume", str(ck / "step-000005")], tmp_path, nproc=2)
        assert_resume_exact(tmp_path / name, tmp_path / "resumed", at=5)
        step5 = ck / "step-000005"
        other = RunLayout.resolve(parse_args(ARGS + ["--mode", "hybrid", *PER_BLOCK, "--batch-size", "1",
                                                     "--grad-accum", "2"]),
                                  2, torch.device("cpu"))  # the same run but for the unit size
        with pytest.raises(CheckpointError, match=r"does not match this run: zero3_unit_blocks: checkpoint 2, this "
                                                  r"run 1 \(--zero3-unit-blocks"):
            check_compatible(read_meta(step5), other, step5)
    else:
        assert ("ZeRO-3 flat parameters: 4 tensors a unit of 2 transformer blocks (other.no_decay_sp, matmul.decay_tp"
                in console)
    _, unit_sd = consolidated_state_dict(ck / "step-000010")
    _, single_sd = consolidated_state_dict(single_reference.checkpoint)
    assert set(unit_sd) == set(single_sd)
    for key, tensor in single_sd.items():
        assert torch.allclose(unit_sd[key], tensor, atol=1e-4, rtol=0), key


def build_ds_config(cfg: RunConfig, dp_size: int, device: torch.device) -> dict:
    """The DeepSpeed config of `cfg` on dp_size ranks (tp 1) of `device`."""
    return build_layout_ds_config(RunLayout.resolve(cfg, dp_size, device))


def _write(tmp_path: Path, ds: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


def test_ds_config_takes_cli_values_and_rejects_disagreement(tmp_path: Path) -> None:
    cfg = parse_args(["--mode", "hybrid", "--batch-size", "8", "--grad-accum", "2", "--grad-clip", "0.5",
                      "--zero-stage", "3", "--precision", "bf16"])
    ds = build_ds_config(cfg, dp_size=4, device=torch.device("cuda"))
    batch_keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    assert [ds[k] for k in batch_keys] == [8, 2, 64]
    assert ds["gradient_clipping"] == 0.5 and ds["zero_optimization"]["stage"] == 3
    # bf16 is torch autocast over fp32 weights, single's recipe; every matmul weight travels in bf16
    assert ds["torch_autocast"]["enabled"] and ds["torch_autocast"]["dtype"] == "bfloat16"
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    safe = ds["torch_autocast"]["lower_precision_safe_modules"]
    assert set(safe) == {"gpt2.model.gpt.Linear", "parallel.layers.ColumnParallelLinear",
                         "parallel.layers.RowParallelLinear", "gpt2.runtime.flat_blocks.MatmulFlatParams"}
    for name in safe:  # DeepSpeed imports them by these names
        module, _, cls = name.rpartition(".")
        assert issubclass(getattr(importlib.import_module(module), cls), torch.nn.Module)
    cfg.parallel.zero_precision = "deepspeed"
    ds16 = build_ds_config(cfg, dp_size=4, device=torch.device("cuda"))
    assert ds16["bf16"]["enabled"] and not ds16["fp16"]["enabled"] and not ds16["torch_autocast"]["enabled"]
    cfg.parallel.zero_precision = "autocast"
    assert ds["zero_optimization"]["overlap_comm"]  # from gpt2/config/ds_configs/zero3.json
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0  # per-block gathers (the default)
    cfg.parallel.zero3_fetch = "module"
    module_ds = build_ds_config(cfg, 4, torch.device("cuda"))
    assert module_ds["zero_optimization"]["stage3_param_persistence_threshold"] == 1e5
    cfg.parallel.zero3_fetch = "block"
    cpu = build_ds_config(cfg, dp_size=4, device=torch.device("cpu"))
    assert not any(cpu[k]["enabled"] for k in ("bf16", "fp16", "torch_autocast"))  # CPU runs are fp32

    cfg.parallel.ds_config = path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match=f"{path} sets train_micro_batch_size_per_gpu=4 but --batch-size is 8"):
        build_ds_config(cfg, 4, torch.device("cpu"))
    cfg.parallel.ds_config = path = _write(tmp_path, {"zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match=f"{path} sets zero_optimization.stage=2 but --zero-stage is 3"):
        build_ds_config(cfg, 4, torch.device("cpu"))
    cfg.parallel.ds_config = path = _write(tmp_path, {"fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match=f"{path} sets fp16.enabled=true but --precision is bf16 with "
                                          "--zero-precision autocast"):
        build_ds_config(cfg, 4, torch.device("cpu"))
    cfg.parallel.ds_config = _write(tmp_path, {"optimizer": {"type": "Adam"}})
    with pytest.raises(ConfigError, match="'optimizer' section"):
        build_ds_config(cfg, 4, torch.device("cpu"))
    cfg.parallel.ds_config = _write(tmp_path, {"train_batch_size": 64, "gradient_clipping": 0.5})
    assert build_ds_config(cfg, 4, torch.device("cpu"))["train_batch_size"] == 64  # agreeing values are fine
    cfg.parallel.ds_config = _write(tmp_path, {"zero_optimization": {"stage3_param_persistence_threshold": 7}})
    assert build_ds_config(cfg, 4, torch.device("cpu"))["zero_optimization"]["stage3_param_persistence_threshold"] == 7


def test_weight_decay_groups_use_full_shapes_of_partitioned_params() -> None:
    """Under ZeRO-3 a parameter's data is an empty 1-D partition; its real shape is ds_shape."""
    from gpt2.runtime.parallelize import param_groups

    matrix, bias = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    matrix.ds_shape, bias.ds_shape = torch.Size([8, 4]), torch.Size([8])
    model = torch.nn.Module()
    model.matrix, model.bias = matrix, bias
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["params"] == [matrix] and no_decay["params"] == [bias]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_zero3_resume_follows_the_new_schedule(runs: Path, tmp_path: Path) -> None:
    """Resuming the 10-step ZeRO-3 run's step-5 checkpoint with --max-steps 20: DeepSpeed restores our LR scheduler,
    then every step's LR, the first resumed one included, is the 20-step schedule's."""
    from gpt2.engines.base import lr_at

    args = [a if a != "10" else "20" for a in ARGS] + ["--mode", "hybrid", "--batch-size", "1", "--grad-accum", "2"]
    run_train(args + ["--run-name", "zero3-longer", "--resume", str(runs / "ck-zero3" / "step-000005")], tmp_path,
              nproc=2)
    t = parse_args(args).train
    logged = {r["step"]: r["lr"] for r in read_records(tmp_path / "zero3-longer") if r["type"] == "step" and "lr" in r}
    assert sorted(logged) == list(range(6, 21))
    for step, lr in logged.items():
        assert lr == pytest.approx(lr_at(step - 1, t), rel=1e-12), step


def test_zero3_keeps_torch_linear_and_refuses_deepspeeds_under_compile(tmp_path: Path) -> None:
    """DeepSpeed's memory-efficient linear (its default) replaces F.linear process-wide and loses its gradients in
    a compiled graph (GPU, torch 2.11): ZeRO-3 turns it off unless the file asks, and refuses it with --compile."""
    cfg = parse_args(["--mode", "hybrid", "--zero-stage", "3"])
    assert build_ds_config(cfg, 1, torch.device("cuda"))["zero_optimization"]["memory_efficient_linear"] is False
    cfg.parallel.ds_config = path = _write(tmp_path, {"zero_optimization": {"memory_efficient_linear": True}})
    assert build_ds_config(cfg, 1, torch.device("cuda"))["zero_optimization"]["memory_efficient_linear"]  # eager
    compiled = parse_args(["--mode", "hybrid", "--zero-stage", "3", "--compile", "--ds-config", path])
    with pytest.raises(ConfigError, match=f"{path} sets zero_optimization.memory_efficient_linear=true.*--compile"):
        build_ds_config(compiled, 1, torch.device("cuda"))


class _Payload:
    """Unpickling this creates a file: proof that a loader executed code from the checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_deepspeed_pickles_are_never_loaded_unverified(runs: Path, tmp_path: Path, monkeypatch) -> None:
    """DeepSpeed's loaders unpickle with weights_only=False: a replaced shard is refused by the manifest check
    before any unpickling, and a hybrid checkpoint without a manifest is refused unless explicitly trusted."""
    from gpt2.train.checkpoint import TRUST_ENV, CheckpointError, verify_checkpoint
    from gpt2.train.export import consolidated_state_dict

    folder = tmp_path / "evil" / "step-000005"
    shutil.copytree(runs / "ck-zero3" / "step-000005", folder)
    shard = sorted((folder / "zero").glob("*.pt"))[0]
    marker = tmp_path / "code-ran"
    torch.save({"payload": _Payload(marker)}, shard)
    with pytest.raises(CheckpointError, match=f"{shard.name} (is .* bytes|does not match its sha256)"):
        consolidated_state_dict(folder)
    assert not marker.exists()
    torch.load(shard, weights_only=False)  # the payload works: the check above is what stopped it
    assert marker.exists()

    legacy = tmp_path / "legacy" / "step-000005"
    shutil.copytree(runs / "ck-zero3" / "step-000005", legacy)
    (legacy / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=f"no manifest.json .* set {TRUST_ENV}=1"):
        verify_checkpoint(legacy)
    monkeypatch.setenv(TRUST_ENV, "1")
    verify_checkpoint(legacy)  # explicitly trusted: loads with a warning


@pytest.mark.parametrize("enabled", [False, True])
def test_deepspeed_nvtx_ranges_follow_the_flag(enabled: bool, monkeypatch) -> None:
    """`--deepspeed-nvtx` (off by default) decides whether DeepSpeed's ZeRO functions push NVTX ranges."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.nvtx import instrument_w_nvtx

    from gpt2.engines.deepspeed_engine import set_deepspeed_nvtx

    pushed: list[str] = []
    monkeypatch.setattr(get_accelerator(), "range_push", lambda msg, **_: pushed.append(msg))
    monkeypatch.setattr(get_accelerator(), "range_pop", lambda **_: None)
    set_deepspeed_nvtx(enabled)
    try:
        assert instrument_w_nvtx(lambda: 7)() == 7
    finally:
        set_deepspeed_nvtx(False)
    assert len(pushed) == int(enabled)
