"""Checkpoint/resume for single and baseline (DDP), export to Hugging Face, and every bad-checkpoint case.

Resume exactness: N steps + resume + M steps give bit-identical losses to N + M uninterrupted steps
(CPU, fp32). ZeRO-3 resume and export are in tests/integration/test_zero.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError

import gpt2.train.checkpoint
from gpt2.config.cli import parse_args
from gpt2.config.layout import RunLayout
from gpt2.planning.planner import plan_for_run
from gpt2.train.checkpoint import EXIT_SAVE_FAILED, CheckpointError, build_meta, check_compatible, resolve_resume
from tests.train_runs import (
    TINY_ARGS,
    assert_hf_export_matches,
    read_records,
    run_train,
    step_losses,
    step_values,
    summary,
    train_error,
)

COMMON = TINY_ARGS + ["--data", "synthetic", "--max-steps", "8", "--seed", "11", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """8 steps with checkpoints at 4 and 8, then a run resumed from step 4 saving every step, keeping 2."""
    root = tmp_path_factory.mktemp("ckpt")
    run_train(COMMON + ["--batch-size", "4", "--run-name", "full", "--save-dir", str(root / "ck"),
                        "--save-interval", "4"], root)
    run_train(COMMON + ["--batch-size", "4", "--run-name", "resumed", "--resume", str(root / "ck" / "step-000004"),
                        "--save-dir", str(root / "ck2"), "--save-interval", "1", "--keep-last", "2"], root)
    return root


def test_single_resume_is_exact_and_layout_is_complete(single: Path) -> None:
    full, resumed = step_losses(single / "full"), step_losses(single / "resumed")
    assert len(full) == 8 and resumed == full[4:]  # bit-identical
    ck = single / "ck"
    assert (ck / "latest").read_text().strip() == "step-000008"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000004", "step-000008"]
    assert sorted(p.name for p in (ck / "step-000004").iterdir()) == [
        "manifest.json", "meta.json", "model.pt", "optimizer.pt", "rank-00000.pt"]
    meta = json.loads((ck / "step-000004" / "meta.json").read_text())
    assert (meta["step"], meta["mode"], meta["world_size"], meta["model"]["n_layer"]) == (4, "single", 1, 2)
    # --keep-last 2 over saves at 5, 6, 7, 8
    assert sorted(p.name for p in (single / "ck2").iterdir()) == ["latest", "step-000007", "step-000008"]
    config = json.loads((single / "resumed" / "config.json").read_text())
    assert config["checkpoint"]["resumed_from"] == str((ck / "step-000004").resolve())
    resumed = summary(single / "resumed")
    assert (resumed["start_step"], resumed["steps"], summary(single / "full")["start_step"]) == (4, 8, 0)


def test_baseline_resume_with_dropout_is_exact_and_layout_is_checked(tmp_path: Path, capsys) -> None:
    """DDP on 2 ranks with dropout, which draws from the RNG every step: only each rank's restored RNG state (torch)
    gives the same masks, so the resumed losses and gradient norms equal the uninterrupted run's."""
    args = COMMON + ["--mode", "baseline", "--batch-size", "2", "--max-steps", "6", "--dropout", "0.1"]
    ck = tmp_path / "ck"
    run_train(args + ["--run-name", "full", "--save-dir", str(ck), "--save-interval", "3"], tmp_path, nproc=2)
    assert sorted(p.name for p in (ck / "step-000003").iterdir()) == [
        "manifest.json", "meta.json", "model.pt", "optimizer.pt", "rank-00000.pt", "rank-00001.pt"]
    run_train(args + ["--run-name", "resumed", "--resume", str(ck / "step-000003")], tmp_path, nproc=2)
    for key in ("loss", "grad_norm"):
        full, resumed = step_values(tmp_path / "full", key), step_values(tmp_path / "resumed", key)
        assert len(full) == 6 and resumed == full[3:], key  # bit-identical

    err = train_error(COMMON + ["--batch-size", "4", "--resume", str(ck / "step-000003")], capsys)
    assert "mode: checkpoint 'baseline', this run 'single'" in err
    assert "world_size: checkpoint 2, this run 1" in err and "dp_size: checkpoint 2, this run 1" in err


def test_bad_checkpoints_fail_at_start_naming_the_problem(single: Path, tmp_path: Path, capsys) -> None:
    ck = single / "ck"
    args = COMMON + ["--batch-size", "4"]
    assert "does not exist" in train_error(args + ["--resume", str(tmp_path / "nothing")], capsys)

    partial = tmp_path / "step-000006.tmp"  # an interrupted save
    shutil.copytree(ck / "step-000004", partial)
    (partial / "meta.json").unlink()
    assert "is a partial checkpoint" in train_error(args + ["--resume", str(partial)], capsys)
    no_meta = tmp_path / "step-000006"
    partial.rename(no_meta)
    assert "has no meta.json" in train_error(args + ["--resume", str(no_meta)], capsys)
    (tmp_path / "latest").write_text("step-000009\n")
    assert "points at step-000009, which is missing" in train_error(args + ["--resume", str(tmp_path)], capsys)

    err = train_error(args + ["--n-layer", "3", "--resume", str(ck / "step-000004")], capsys)
    assert "model.n_layer: checkpoint 2, this run 3" in err and "--init-from" in err

    # a fresh run into a save dir that holds another run's checkpoints: refused before training, whether or not it
    # would write the same steps (it would move `latest`, and --keep-last would delete that run's checkpoints)
    for extra in (["--save-interval", "4"], ["--max-steps", "3", "--keep-last", "1"]):
        err = train_error(args + ["--save-dir", str(ck)] + extra, capsys)
        assert "already holds checkpoints of another run (step-000004 ... step-000008)" in err
        assert "--resume auto" in err
    # a resume must keep the data order: batch size, sequence length and seed are checked before any work
    err = train_error(COMMON + ["--batch-size", "2", "--seed", "12", "--resume", str(ck / "step-000004")], capsys)
    assert "batch_size: checkpoint 4, this run 2" in err and "seed: checkpoint 11, this run 12" in err
    # --resume auto takes `latest` (step 8), which is not before --max-steps 8
    assert "is at step 8, not before --max-steps 8" in train_error(
        args + ["--save-dir", str(ck), "--resume", "auto"], capsys)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000004", "step-000008"]  # untouched


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("meta.json", '{"step": 4, "mo', "meta.json is damaged (Unterminated string"),
    ("meta.json", "[]", "meta.json is damaged (not a checkpoint's meta record)"),
    ("meta.json", "\udcff", "meta.json is damaged"),
    ("manifest.json", '{"version": 1, "files": {"model.pt": 5}}', "is not a valid checkpoint manifest"),
])
def test_a_damaged_meta_or_manifest_is_one_line_at_resume_and_export(single: Path, tmp_path: Path, capsys, name: str,
                                                                     text: str, needle: str) -> None:
    """meta.json is read before the manifest check (it says what to verify): damaged, it is refused, not a
    traceback; so is a manifest whose entries are not what the save writes."""
    from gpt2.train.export import main as export_main

    ck = tmp_path / "ck" / "step-000004"
    shutil.copytree(single / "ck" / "step-000004", ck)
    (ck / name).write_bytes(text.encode(errors="surrogateescape"))
    assert needle in train_error(COMMON + ["--batch-size", "4", "--resume", str(ck)], capsys)
    assert export_main([str(ck), str(tmp_path / "hf")]) == 2
    assert needle in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_a_wrong_checkpoint_path_gets_the_right_advice(single: Path, tmp_path: Path, capsys) -> None:
    """A file inside a checkpoint exists (not "does not exist"); a save dir without `latest` is one (not "foreign")."""
    from gpt2.train.export import main as export_main

    model = single / "ck" / "step-000004" / "model.pt"
    err = train_error(COMMON + ["--batch-size", "4", "--resume", str(model)], capsys)
    assert f"{model} is a file, not a checkpoint folder; pass the step folder that holds it ({model.parent})" in err
    ck = tmp_path / "ck"
    shutil.copytree(single / "ck", ck)
    (ck / "latest").unlink()
    assert export_main([str(ck), str(tmp_path / "hf")]) == 2
    assert (f"{ck} is a save dir without a `latest` pointer; pass one of its step folders (the newest: "
            f"{ck / 'step-000008'})") in capsys.readouterr().err


def test_export_checks_its_output_folder_before_the_gather(single: Path, tmp_path: Path, capsys) -> None:
    from gpt2.train.export import main as export_main

    (tmp_path / "f").write_text("a user's file")
    assert export_main([str(single / "ck"), str(tmp_path / "f" / "hf")]) == 2
    assert f"output folder {tmp_path / 'f' / 'hf'} cannot be created: {tmp_path / 'f'} is a file" in (
        capsys.readouterr().err)


@pytest.mark.parametrize(("stop", "code"), [
    (KeyboardInterrupt(), 130), (OSError(errno.ENOSPC, "No space left"), 74),
    (SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                     'device" })'), 74)])  # safetensors' writer on a full disk
def test_an_export_stopped_mid_write_leaves_no_partial_folder(single: Path, tmp_path: Path, capsys,
                                                              monkeypatch: pytest.MonkeyPatch, stop: BaseException,
                                                              code: int) -> None:
    from transformers import GPT2LMHeadModel

    from gpt2.train.export import main as export_main

    def save_pretrained(self, folder, *args, **kwargs):
        (Path(folder) / "config.json").write_text("{}")  # a first file, then the stop
        raise stop

    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", save_pretrained)
    (tmp_path / "out").mkdir()
    assert export_main([str(single / "ck"), str(tmp_path / "out" / "hf")]) == code
    assert "gpt2.train.export: " in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []  # neither hf/ nor the temporary folder


def test_export_never_writes_into_what_it_reads_and_leaves_nothing_when_stopped(
        single: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output folder inside the checkpoint is refused (the checkpoint stays resumable); SIGTERM mid-write exits
    143 leaving nothing, and a later export removes what a killed one left; the export honours the umask."""
    from transformers import GPT2LMHeadModel

    from gpt2.train.checkpoint import verify_checkpoint
    from gpt2.train.export import main as export_main

    ck = tmp_path / "ck"
    shutil.copytree(single / "ck", ck)
    for source, inside in ((ck, ck / "hf"), (ck / "step-000008", ck / "step-000008" / "hf")):
        assert export_main([str(source), str(inside)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"output folder {inside} is inside the checkpoint {source}" in err, err
    verify_checkpoint(ck / "step-000008")

    out = tmp_path / "out"
    out.mkdir()
    killed = out / ".hf.export-4194305-x1y2"  # a killed export's folder: above any pid_max, so no live process
    killed.mkdir()
    real_save = GPT2LMHeadModel.save_pretrained

    def terminated(self, folder, *args, **kwargs):
        (Path(folder) / "config.json").write_text("{}")
        signal.raise_signal(signal.SIGTERM)

    def unexpected(signum: int, frame: object) -> None:
        pytest.fail("SIGTERM reached the test's handler: the export installed none")

    previous = signal.signal(signal.SIGTERM, unexpected)
    try:
        monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", terminated)
        assert export_main([str(ck), str(out / "hf")]) == 143
        assert "stopped by SIGTERM" in capsys.readouterr().err
        assert list(out.iterdir()) == []  # the killed export's folder too
        assert signal.getsignal(signal.SIGTERM) is unexpected
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", real_save)
    old_mask = os.umask(0o022)
    try:
        assert export_main([str(ck), str(out / "hf")]) == 0
    finally:
        os.umask(old_mask)
    assert (out / "hf").stat().st_mode & 0o777 == 0o755


def test_checkpoint_files_are_verified_before_any_load(single: Path, tmp_path: Path, capsys) -> None:
    """manifest.json (sha256 + size of every file, written last) is checked before anything is loaded: a truncated,
    modified, missing or unlisted file is refused naming it, at resume and at export."""
    from gpt2.train.export import consolidated_state_dict

    args = COMMON + ["--batch-size", "4", "--max-steps", "9"]
    src = single / "ck" / "step-000008"
    manifest = json.loads((src / "manifest.json").read_text())["files"]
    assert sorted(manifest) == ["meta.json", "model.pt", "optimizer.pt", "rank-00000.pt"]
    assert manifest["model.pt"]["size"] == (src / "model.pt").stat().st_size

    def broken(name: str, damage) -> Path:
        folder = tmp_path / name / "step-000008"
        shutil.copytree(src, folder)
        damage(folder)
        return folder

    def truncate(folder: Path) -> None:
        data = (folder / "model.pt").read_bytes()
        (folder / "model.pt").write_bytes(data[: len(data) // 2])

    def flip(folder: Path) -> None:
        data = bytearray((folder / "optimizer.pt").read_bytes())
        data[-100] ^= 0xFF
        (folder / "optimizer.pt").write_bytes(bytes(data))

    cases = {
        "truncated": (truncate, "model.pt is .* bytes, manifest.json says"),
        "modified": (flip, "optimizer.pt does not match its sha256"),
        "foreign": (lambda f: shutil.copy(f / "model.pt", f / "extra.pt"), "extra.pt is not in manifest.json"),
        "missing": (lambda f: (f / "rank-00000.pt").unlink(), "rank-00000.pt is listed in .* but missing"),
    }
    for name, (damage, message) in cases.items():
        folder = broken(name, damage)
        err = train_error(args + ["--resume", str(folder)], capsys)
        assert re.search(message, err), (name, err)
        with pytest.raises(CheckpointError, match=message):
            consolidated_state_dict(folder)

    # a checkpoint from before manifests (our weights_only files) resumes with a warning: a launch of
    # test_resume_follows_the_new_schedule_when_max_steps_grows


def test_zero_stage_mismatch_is_named(single: Path) -> None:
    meta = json.loads((single / "ck" / "step-000004" / "meta.json").read_text())
    meta.update(mode="hybrid", world_size=2, dp_size=2, zero_stage=3)
    cfg = parse_args(COMMON + ["--mode", "hybrid", "--zero-stage", "2", "--batch-size", "2"])
    with pytest.raises(CheckpointError, match="zero_stage: checkpoint 3, this run 2"):
        check_compatible(meta, RunLayout.resolve(cfg, 2, "cpu"), Path("x"))


def test_export_loads_in_transformers_and_as_init_from(single: Path, tmp_path: Path) -> None:

    from gpt2.data.loader import build_data
    from gpt2.train.export import consolidated_state_dict, export_hf

    export_hf(single / "ck" / "step-000008", tmp_path / "hf")
    cfg, sd = consolidated_state_dict(single / "ck" / "step-000008")
    ours, _ = assert_hf_export_matches(cfg, sd, tmp_path / "hf")

    # --init-from the export: the first logged loss is the exported model's loss on the first batch
    run_train(COMMON + ["--batch-size", "4", "--max-steps", "1", "--run-name", "init", "--init-from",
                        str(tmp_path / "hf")], tmp_path)
    run_cfg = parse_args(COMMON + ["--batch-size", "4"])
    data = build_data(run_cfg.data, seq_len=32, batch_size=4, model_vocab_size=cfg.vocab_size, dp_rank=0,
                      dp_size=1, seed=11, is_main=True, barrier=lambda: None)
    x, y = data.train.next_batch()
    with torch.no_grad():
        expected, _ = ours(x, y)
    assert abs(step_losses(tmp_path / "init")[0] - expected.item()) < 1e-5


def test_resume_with_other_grad_accum_is_refused(tmp_path: Path) -> None:
    """The data position counts micro-batches: another accumulation would replay or skip data."""
    def layout(argv: list[str]) -> RunLayout:
        return RunLayout.resolve(parse_args(argv), 1, "cpu")

    meta = build_meta(layout(["--grad-accum", "2"]), step=5)
    check_compatible(meta, layout(["--grad-accum", "2"]), tmp_path)
    with pytest.raises(CheckpointError, match="grad_accum: checkpoint 2, this run 1"):
        check_compatible(meta, layout([]), tmp_path)


def test_another_zero_engines_checkpoint_names_the_engine_only(tmp_path: Path) -> None:
    """An FSDP2 checkpoint under DeepSpeed (and back): the engine is the difference; DeepSpeed's fetch flags, which
    FSDP2 refuses, are no advice for it."""
    def layout(argv: list[str]) -> RunLayout:
        return RunLayout.resolve(parse_args(["--mode", "hybrid", *argv]), 2, "cpu")

    fsdp2, deepspeed = layout(["--zero-engine", "fsdp2"]), layout([])
    for saved, resumed in ((fsdp2, deepspeed), (deepspeed, fsdp2)):
        with pytest.raises(CheckpointError, match="zero_engine: checkpoint") as refused:
            check_compatible(build_meta(saved, step=5), resumed, tmp_path)
        assert "zero3" not in str(refused.value), refused.value


def test_resume_follows_the_new_schedule_when_max_steps_grows(single: Path, tmp_path: Path) -> None:
    """Resuming the 8-step run's step-4 checkpoint with --max-steps 16 (a warning says so, naming the flag that keeps
    the old schedule): every step's LR, the first resumed one included, is the 16-step schedule's
    (gpt2.engines.base.lr_at), not the checkpoint's stale 8-step value. The copy resumed has no manifest.json (a
    checkpoint from before manifests, for test_checkpoint_files_are_verified_before_any_load): our weights_only
    files load with a warning."""
    from gpt2.config.cli import parse_args
    from gpt2.engines.base import lr_at

    legacy = tmp_path / "legacy" / "step-000004"
    shutil.copytree(single / "ck" / "step-000004", legacy)
    (legacy / "manifest.json").unlink()
    args = [a if a != "8" else "16" for a in COMMON] + ["--batch-size", "4"]
    proc = run_train(args + ["--run-name", "longer", "--resume", str(legacy)], tmp_path)
    assert "has no manifest.json" in proc.stderr and "weights_only=True" in proc.stderr
    assert ("the checkpoint at step 4 was made by a run of --max-steps 8; this run's --max-steps 16 recomputes the LR "
            "schedule" in proc.stderr and "pass --max-steps 8 to keep" in proc.stderr), proc.stderr[-2000:]
    t = parse_args(args).train
    logged = {r["step"]: r["lr"] for r in read_records(tmp_path / "longer") if r["type"] == "step" and "lr" in r}
    assert sorted(logged) == list(range(5, 17))
    for step, lr in logged.items():
        assert lr == pytest.approx(lr_at(step - 1, t), rel=1e-12), step  # lr_at counts optimizer steps from 0


def test_keep_last_never_deletes_the_checkpoint_just_written(single: Path, tmp_path: Path) -> None:
    """Resuming from an older step of a save dir that holds newer ones (a branch): --keep-last prunes only
    checkpoints older than the new one, so `latest` never points at a deleted folder and the newer ones stay."""
    ck = tmp_path / "ck"
    shutil.copytree(single / "ck", ck)  # step-000004, step-000008, latest -> 8
    run_train(COMMON + ["--batch-size", "4", "--max-steps", "6", "--run-name", "branch", "--resume",
                        str(ck / "step-000004"), "--save-dir", str(ck), "--keep-last", "1"], tmp_path)
    assert (ck / "latest").read_text().strip() == "step-000006"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000006", "step-000008"]


def test_too_little_space_for_a_checkpoint_fails_at_start_up(tmp_path: Path, capsys,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's checkpoint size (gpt2-tiny: 40 MB) against the save dir's free space, before any work."""
    free = {"bytes": 10 * 2**20}
    monkeypatch.setattr(gpt2.train.checkpoint.shutil, "disk_usage", lambda path: SimpleNamespace(free=free["bytes"]))
    err = train_error(COMMON + ["--save-dir", str(tmp_path / "ck")], capsys, tmp_path / "runs")
    assert f"--save-dir {tmp_path / 'ck'}: 0.01 GiB free, but one checkpoint of this run needs about 0.04 GiB" in err
    assert not (tmp_path / "runs").exists()
    warned = []
    monkeypatch.setattr(gpt2.train.checkpoint.log, "warning", lambda *args: warned.append(args[0] % args[1:]))
    free["bytes"] = 100 * 2**20  # two checkpoints, not the eight of --save-interval 1
    layout = RunLayout.resolve(parse_args(COMMON + ["--save-dir", str(tmp_path / "ck"), "--save-interval", "1"]),
                               world_size=1, device="cpu")
    gpt2.train.checkpoint.check_save_space(layout, start_step=0,
                                           checkpoint_size=plan_for_run(layout).checkpoint_bytes)
    assert "the 8 checkpoints this run keeps need about 0.30 GiB" in warned[0] and "--keep-last" in warned[0]
    layout = RunLayout.resolve(parse_args(COMMON + ["--save-dir", str(tmp_path / "ck"), "--save-interval", "1",
                                                    "--keep-last", "1"]), world_size=1, device="cpu")
    gpt2.train.checkpoint.check_save_space(layout, start_step=0,
                                           checkpoint_size=plan_for_run(layout).checkpoint_bytes)  # 2 fit
    assert len(warned) == 1


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/0: file "
                 "write failed"),
    OSError(errno.ENOSPC, "No space left on device"),
])
def test_a_disk_that_fills_during_a_save_stops_in_one_line(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch,
                                                           failure: Exception) -> None:
    """The save of step 2 fails as torch.save fails on a full disk: exit 74, one line naming the step and the
    newest good checkpoint, which --resume auto then takes."""
    import train

    real_save, free = torch.save, {"bytes": 2**40}

    def save(obj, path, *args, **kwargs):
        if "step-000002" in str(path):
            free["bytes"] = 0
            raise failure
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(gpt2.train.checkpoint.torch, "save", save)
    monkeypatch.setattr(gpt2.train.checkpoint.shutil, "disk_usage", lambda path: SimpleNamespace(free=free["bytes"]))
    ck = tmp_path / "ck"
    args = COMMON + ["--max-steps", "3", "--save-interval", "1", "--save-dir", str(ck)]
    assert train.main(args + ["--out-dir", str(tmp_path / "runs")]) == EXIT_SAVE_FAILED
    err = capsys.readouterr().err
    assert re.search(r"no space left on device \(0\.00 GiB free, a checkpoint needs about 0\.04 GiB\) while "
                     rf"saving step 2 in {re.escape(str(ck))}/step-000002\.tmp; latest good checkpoint: "
                     rf"{re.escape(str(ck))}/step-000001 .*; exit 74", err), err
    assert "Traceback" not in err
    assert resolve_resume(parse_args(args + ["--resume", "auto"]).checkpoint) == ck / "step-000001"
