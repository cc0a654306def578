"""tools.parity, the loss-parity tool: end to end on CPU (gpt2-tiny, fp32, real text), its verdict API on
synthetic curves, and the parity gate of tools.train_sweep."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from gpt2.config.cli import parse_args
from gpt2.data.loader import build_data
from gpt2.observe.metrics import host_cpu
from gpt2.runtime.distributed import LAUNCHER_VARS
from tests.train_runs import ROOT, SHARED_DATA, train_env
from tests.unit.test_data import tiny_tokenizer, wiki_lines, write  # noqa: F401 (tiny_tokenizer: a fixture)
from tools import common, parity, parity_verdict, train_sweep
from tools.common import write_csv
from tools.parity_matrix import Row, extra_row, matrix, plan
from tools.parity_verdict import (
    Curve,
    CurveError,
    compare,
    config_key,
    load_curve,
    read_verdicts,
    tolerance,
)

TINY = ["--models", "gpt2-tiny", "--seq-len", "32", "--batch-size", "8", "--steps", "6", "--warmup-steps", "2",
        "--eval-batches", "2", "--device", "cpu", "--jobs", "2"]
REQUIRED_COLUMNS = {"config", "model", "max_abs_dloss", "final_dloss", "val_dloss", "tolerance", "verdict", "steps",
                    "command"}


@pytest.fixture
def cpu_env(monkeypatch):
    """What the launched runs need on a 2-core CPU machine (one thread each, DeepSpeed's CPU accelerator)."""
    for key, value in train_env().items():
        monkeypatch.setenv(key, value)
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def text_data(tmp_path_factory, request) -> list[str]:
    """Data flags: WikiText-2 and the GPT-2 tokenizer from ../shared/data, else a small corpus written here with a
    tiny BPE trained on it; one token cache for the module."""
    cache = ["--cache-dir", str(tmp_path_factory.mktemp("cache"))]
    wikitext, tokenizer = SHARED_DATA / "wikitext-2", SHARED_DATA / "gpt2-tokenizer" / "tokenizer.json"
    if wikitext.is_dir() and tokenizer.is_file():
        return ["--data-path", str(wikitext), "--tokenizer", str(tokenizer), *cache]
    corpus = tmp_path_factory.mktemp("corpus")
    write(corpus / "train.txt", wiki_lines(300, seed=1))
    write(corpus / "valid.txt", wiki_lines(60, seed=2))
    return ["--data-path", str(corpus), "--tokenizer", str(request.getfixturevalue("tiny_tokenizer")), *cache]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_equivalent_configurations_pass(tmp_path, cpu_env, text_data):
    """single, noise, grad accumulation, DDP and ZeRO-3 (torchrun, world 1) train one function: all pass."""
    rc = parity.main([*TINY, *text_data, "--rows", "grad-accum", "ddp", "zero3", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "parity.csv")
    assert rc == 0, [(r["config"], r["verdict"], r["note"]) for r in rows]
    assert set(rows[0]) >= REQUIRED_COLUMNS
    assert {r["config"]: r["verdict"] for r in rows} == {
        "single": "reference", "noise": "noise", "grad-accum": "pass", "ddp": "pass", "zero3": "pass"}
    by_name = {r["config"]: r for r in rows}
    noise, tol = float(by_name["noise"]["max_abs_dloss"]), float(by_name["single"]["tolerance"])
    assert tol == pytest.approx(max(1e-4, 3 * noise))  # the fp32 floor: CPU runs compute in fp32
    assert all(r["steps"] == "6" and float(r["max_abs_dloss"]) <= tol for r in rows)
    # the same global batch of 8 and the same 2 x 8 validation sequences in every layout
    accum = by_name["grad-accum"]["command"]
    assert "--grad-accum 4 --batch-size 2 --eval-batches 8" in accum and accum.startswith(f"{parity.sys.executable} ")
    assert int(re.search(r"--max-samples (\d+)", accum).group(1)) % 8 == 0  # whole global batches: epochs line up
    assert re.search(r"torch\.distributed\.run --standalone --nproc_per_node=1 ", by_name["zero3"]["command"])
    for r in rows:  # every run trained and logged each step
        assert load_curve(Path(r["run_dir"])).steps == (1, 2, 3, 4, 5, 6)
    md = (tmp_path / "parity.md").read_text()
    assert "tolerance = max(floor, factor x noise)" in md and "- device: cpu" in md and "deepspeed 0." in md
    assert f"- host: {host_cpu()}" in md
    assert re.search(r"\| grad-accum \| python \| `--grad-accum 4` \| [\d.e+-]+ \|", md)
    assert (tmp_path / "parity_gpt2-tiny.png").stat().st_size > 10_000


@pytest.mark.slow
def test_another_function_fails_and_a_broken_run_errors(tmp_path, cpu_env, text_data):
    """A row with twice the learning rate is `fail`, one whose run cannot start is `error`: exit status 1."""
    rc = parity.main([*TINY, *text_data, "--rows", "single", "--extra-row", "lr-x2=--lr 1.2e-3",
                      "--extra-row", "broken=--resume /nonexistent", "--out", str(tmp_path)])
    assert rc == 1
    rows = {r["config"]: r for r in read_csv(tmp_path / "parity.csv")}
    assert set(rows) == {"single", "noise", "lr-x2", "broken"}
    lr = rows["lr-x2"]
    assert lr["verdict"] == "fail" and float(lr["max_abs_dloss"]) > 10 * float(lr["tolerance"])
    assert rows["broken"]["verdict"] == "error" and "exit 2" in rows["broken"]["note"]
    md = (tmp_path / "parity.md").read_text()
    assert "| lr-x2 | python | `--lr 1.2e-3` |" in md and "**fail**" in md
    assert "### gpt2-tiny broken" in md and "checkpoint /nonexistent does not exist" in md  # its last output lines


def test_a_stopped_call_keeps_the_verdicts_of_the_rows_that_ended(tmp_path, cpu_env, text_data, monkeypatch):
    """The tables are rewritten as each run ends, and once more when the tool is stopped (SIGTERM: `timeout`, the
    device call's limit): a row that wrote its summary but was still exiting is judged from it (on two H200s a call's
    tool was stopped while two finished rows exited, and wrote no verdict for them), a row never started is
    `pending`, and the header says how many ended; --store keeps the verdicts reached."""
    real_launch = parity.launch
    monkeypatch.setattr(common, "_STOPPING", threading.Event())  # the handler sets it: this test's own
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def stop_while_again_exits(cmd, log, timeout, env):
        rc, wall = real_launch(cmd, log, timeout, env)
        if "again-gpt2-tiny" in cmd:  # its summary is written; the tool is stopped before its launch returns
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # still "exiting" while the main thread handles the signal
        return rc, wall

    monkeypatch.setattr(parity, "launch", stop_while_again_exits)
    try:
        with pytest.raises(SystemExit) as stopped:
            parity.main([*TINY, *text_data, "--jobs", "1", "--rows", "single", "--extra-row",
                         "again=--log-interval 1", "--extra-row", "slow=--lr 6e-4", "--out", str(tmp_path),
                         "--store", str(tmp_path / "store.csv"), "--call", "stopped"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert stopped.value.code == 128 + signal.SIGTERM
    rows = {r["config"]: (r["verdict"], r["note"]) for r in read_csv(tmp_path / "parity.csv")}
    assert rows == {"single": ("reference", ""), "noise": ("noise", "sets the tolerance"),
                    "again": ("pass", "judged from its summary: the call was stopped while the run exited"),
                    "slow": ("pending", "still running when this table was written")}
    assert "partial: 3 of 4 runs ended" in (tmp_path / "parity.md").read_text()
    stored = read_csv(tmp_path / "store.csv")
    assert [(r["kind"], r["variant"], r["parity"], r["call"]) for r in stored] == [
        ("parity", "again", "pass", "stopped")]
    # `slow` shares single's configuration key (the lr is not part of it): a key with a row still running is not
    # passing, so a sweep reading this partial table publishes nothing on it
    key = config_key(parse_args(["--model", "gpt2-tiny"]).to_dict(), 1)
    assert read_verdicts([tmp_path / "parity.csv"])[key] == "pending"


def test_a_call_stopped_after_storing_stores_nothing_twice(tmp_path, cpu_env, text_data, monkeypatch):
    """The device call's limit can fire after the verdicts went to the store: the stop handler then stores none
    again."""
    real_store = parity.store_verdicts
    monkeypatch.setattr(common, "_STOPPING", threading.Event())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def store_then_stop(results, out, args):
        ids = real_store(results, out, args)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)  # the handler runs while this call is still on the stack
        return ids

    monkeypatch.setattr(parity, "store_verdicts", store_then_stop)
    try:
        with pytest.raises(SystemExit):
            parity.main([*TINY, *text_data, "--jobs", "1", "--rows", "single", "--extra-row", "again=--log-interval 1",
                         "--out", str(tmp_path), "--store", str(tmp_path / "store.csv"), "--call", "late"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert [r["variant"] for r in read_csv(tmp_path / "store.csv")] == ["again"]


def test_a_row_that_ends_before_the_reference_is_pending_not_judged(tmp_path):
    """With several rows at once a row can end before single or noise: a partial table then says `pending` for it,
    not an `error` (no reference yet) or a verdict against the floor alone (no noise yet)."""
    import argparse

    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--data", "synthetic"]
    rows = {row.name: row for row in matrix(1)}
    jobs = [plan(rows[name], "gpt2-tiny", common, 8, 2, "cpu") for name in ("single", "noise", "compile-model")]
    ended = parity.Outcome("cmd", 0, 1.0, tmp_path / "run", tmp_path / "log")
    args = argparse.Namespace(tol_floor=None, tol_factor=3.0)
    results, _ = parity.judge(jobs, {jobs[2]: ended}, args)
    assert [(r.config, r.verdict) for r in results] == [("single", "pending"), ("noise", "pending"),
                                                         ("compile-model", "pending")]
    assert "judged once single and noise have ended" in results[2].note


def test_the_noise_row_sees_the_reference_s_batches_past_the_first_epoch(text_data):
    """prepare_data cuts the training set to whole global batches, so single (batch 8) and noise (4 x accum 2) roll
    over together and see the same sequences at every step of later epochs; with half a batch more, noise
    reaches the end of its epoch one step after single."""
    common = ["--model", "gpt2-tiny", "--seq-len", "256", *text_data]
    max_samples, _ = parity.prepare_data(common, 8, 2)
    assert max_samples % 8 == 0

    def aligned_steps(blocks: int) -> int:
        def loader(batch: int):
            cfg = parse_args([*common, "--batch-size", str(batch), "--max-samples", str(blocks)])
            return build_data(cfg.data, seq_len=256, batch_size=batch, model_vocab_size=cfg.model.vocab_size,
                              dp_rank=0, dp_size=1, seed=cfg.train.seed, is_main=True, barrier=lambda: None).train

        ref, noise = loader(8), loader(4)
        for step in range(2 * len(ref) + 3):  # past two epoch ends
            x, _ = ref.next_batch()
            if not torch.equal(x, torch.cat([noise.next_batch()[0], noise.next_batch()[0]])):
                return step
        assert ref.epoch == 2
        return step + 1

    assert aligned_steps(max_samples) == 2 * max_samples // 8 + 3
    assert aligned_steps(max_samples - 4) == (max_samples - 4) // 8  # half a batch more: apart from epoch 2 on


def test_device_slots_spread_one_gpu_rows_and_give_a_wide_row_every_gpu():
    """Four one-GPU takes land on four different GPUs; a four-GPU take waits until each has a free slot again."""
    slots = parity.DeviceSlots(["0", "1", "2", "3"], per_device=1)
    wide: list[list[str]] = []

    def take_all() -> None:
        with slots.take(4) as devices:
            wide.append(devices)

    with slots.take(1) as a, slots.take(1) as b, slots.take(1) as c:
        with slots.take(1) as d:
            assert sorted(a + b + c + d) == ["0", "1", "2", "3"]
            waiter = threading.Thread(target=take_all)
            waiter.start()
            waiter.join(0.2)
            assert not wide  # every GPU is busy
        waiter.join(0.2)
        assert not wide  # one GPU is free, three are not
    waiter.join(30)
    assert wide == [["0", "1", "2", "3"]]
    # first come, first served: with a wide row waiting, a one-GPU row that asks later waits behind it
    order: list[str] = []

    def take(n: int, name: str) -> None:
        with slots.take(n):
            order.append(name)

    with slots.take(1):
        wide_row = threading.Thread(target=take, args=(4, "wide"))
        wide_row.start()
        while not slots.queue:
            time.sleep(0.01)
        narrow = threading.Thread(target=take, args=(1, "narrow"))
        narrow.start()
        narrow.join(0.2)
        assert order == []  # three GPUs are free, but the wide row asked first
    wide_row.join(30)
    narrow.join(30)
    assert order == ["wide", "narrow"]
    with pytest.raises(ValueError, match="needs 5 devices, 4 visible"), slots.take(5):
        pass


def test_run_all_gives_each_row_its_gpus_and_never_two_rows_one_gpu(tmp_path, monkeypatch):
    """run_all on 4 GPUs at --jobs 1: each one-GPU row's CUDA_VISIBLE_DEVICES names one GPU, the torchrun row of 4
    names all four, and no GPU ever runs two rows at once (counted inside the launches)."""
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--data", "synthetic"]
    rows = [Row(f"one-{i}") for i in range(6)] + [Row("ddp-w4", ("--mode", "baseline"), 4)]
    jobs = [plan(row, "gpt2-tiny", common, 8, 2, "cuda") for row in rows]
    busy: dict[str, int] = {}
    worst: dict[str, int] = {}
    seen: dict[str, str] = {}
    lock = threading.Lock()

    def fake_launch(cmd, log, timeout, env):
        devices = env["CUDA_VISIBLE_DEVICES"].split(",")
        with lock:
            seen[cmd[cmd.index("--run-name") + 1]] = env["CUDA_VISIBLE_DEVICES"]
            for d in devices:
                busy[d] = busy.get(d, 0) + 1
                worst[d] = max(worst.get(d, 0), busy[d])
        time.sleep(0.05)
        with lock:
            for d in devices:
                busy[d] -= 1
        return 0, 0.05

    monkeypatch.setattr(parity, "launch", fake_launch)
    outcomes = parity.run_all(jobs, parity.name_runs(jobs, tmp_path), tmp_path,
                              parity.DeviceSlots(["0", "1", "2", "3"], 1), 60.0, gpus=True)
    assert len(outcomes) == 7 and all(o.rc == 0 for o in outcomes.values())
    assert all(len(seen[f"one-{i}-gpt2-tiny"].split(",")) == 1 for i in range(6))
    assert sorted(seen["ddp-w4-gpt2-tiny"].split(",")) == ["0", "1", "2", "3"]
    assert max(worst.values()) == 1


def test_matrix_keeps_the_global_batch_in_every_layout():
    """With 4 GPUs the matrix adds DDP/ZeRO at world 4 and the TP rows; every row trains on 8 sequences per step and
    evaluates the same 2 x 8, whatever its dp x grad-accum split (what the CPU runs above cannot show)."""
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--data", "synthetic"]
    jobs = {row.name: plan(row, "gpt2-tiny", common, 8, 2, "cuda") for row in matrix(4)}
    assert {"ddp-w4", "zero1-w4", "zero3-w4", "ddp-tp2-w4", "ddp-tp2-sp-w4", "zero3-tp2-sp-w4", "zero3-tp2-compile-w4",
            "ddp-tp2-compile-w4", "zero3-tp2-sp-compile-w4", "ddp-tp4-w4", "zero3-tp4-w4", "ddp-compile-w4",
            "zero3-compile-w4", "ddp-cuda-compile-w4", "zero3-tp2-cuda-compile-w4",
            "fsdp2-tp2-cuda-compile-w4"} <= set(jobs)
    assert " kernels=cuda " in jobs["zero3-tp2-cuda-compile-w4"].key  # the sweep's --fused cuda rows find it
    # ZeRO-3's default gather: flat units of 4 blocks, or of the largest divisor of gpt2-tiny's 2; the per-block row
    assert jobs["zero3-tp2-compile-w4"].key.endswith(" fetch=flat unit=2 zprec=autocast wrapper=cpp")
    assert jobs["zero3-tp2-block-compile-w4"].key.endswith(" fetch=block zprec=autocast wrapper=cpp")
    large = plan({r.name: r for r in matrix(4)}["zero3-tp2-compile-w4"], "gpt2-large",
                 ["--model", "gpt2-large"], 32, 2, "cuda")  # 36 blocks: 9 units
    assert not large.skip and large.key.endswith(" fetch=flat unit=4 zprec=autocast wrapper=cpp")
    u4 = plan(extra_row("zero3-u4-w4=--mode hybrid --zero3-unit-blocks 4"), "gpt2-tiny", common, 8, 2, "cuda")
    assert "does not divide the model's 2 blocks" in u4.skip
    assert not any("tp4" in row.name for row in matrix(2))  # TP 4 only where 4 divides the world

    def flag(job, name: str) -> int:
        return int(job.argv[job.argv.index(name) + 1])

    for name in ("single", "grad-accum", "ddp", "ddp-w4", "zero3-tp2-w4", "zero3-tp2-sp-w4", "zero3-tp4-w4"):
        job = jobs[name]
        dp = (job.row.nproc or 1) // (4 if "tp4" in name else 2 if "tp2" in name else 1)
        accum = flag(job, "--grad-accum") if "--grad-accum" in job.argv else 1
        assert flag(job, "--batch-size") * dp * accum == 8 and flag(job, "--eval-batches") == 2 * accum, name
    assert jobs["zero3-tp2-sp-w4"].key.startswith("gpt2-tiny zero3-tp2-sp w4 ")
    assert "does not divide" in plan(Row("tp2-w3", ("--mode", "baseline", "--tp-size", "2"), 3), "gpt2-tiny",
                                     common, 8, 2, "cuda").skip


def test_an_extra_row_runs_the_world_its_name_ends_in():
    """`--extra-row NAME-wN=FLAGS` is a row of world size N, as the matrix's `-wN` rows are (a wrapper's parity at 4
    GPUs: its key names the world and the wrapper, as the sweep's runs will); without -wN one process per TP rank."""
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--data", "synthetic"]
    row = extra_row("ddp-cpp-compile-w4=--mode baseline --compile --compile-wrapper cpp")
    assert (row.name, row.nproc) == ("ddp-cpp-compile-w4", 4)
    job = plan(row, "gpt2-tiny", common, 8, 2, "cuda")
    assert job.key.startswith("gpt2-tiny ddp w4 ") and " wrapper=cpp" in job.key
    assert job.argv[job.argv.index("--batch-size", len(common)) + 1] == "2"  # 8 sequences over 4 ranks
    assert extra_row("tp2=--mode hybrid --tp-size 2").nproc == 2 and extra_row("lr=--lr 1e-3").nproc is None
    assert "does not divide" in plan(extra_row("tp2-w3=--mode hybrid --tp-size 2"), "gpt2-tiny", common, 8, 2,
                                     "cuda").skip
    with pytest.raises(ValueError, match="drop -w4"):
        extra_row("single-w4=--lr 1e-3")


def test_each_model_is_judged_at_its_own_protocol(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gpt2-large at gpt2's lr 6e-4 spikes and fails rows that train the right function: without flags each model
    gets its own protocol (gpt2-large: global 32 at micro-batch 2, 10 steps, lr 2.5e-4, warm-up 5), and a flag
    replaces only its own field."""
    def commands(*flags: str) -> dict[str, list[str]]:
        assert parity.main(["--out", str(tmp_path), "--models", "gpt2", "gpt2-large", "--rows", "single",
                            "--data", "synthetic", "--device", "cpu", "--dry-run", *flags]) == 0
        lines = [line.split() for line in capsys.readouterr().out.splitlines() if "--run-name single-" in line]
        return {argv[argv.index("--model") + 1]: argv for argv in lines}

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    default = commands()
    small, large = default["gpt2"], default["gpt2-large"]
    assert [flag(small, f) for f in ("--lr", "--warmup-steps", "--max-steps", "--batch-size")] == ["0.0006", "10",
                                                                                                  "30", "8"]
    assert [flag(large, f) for f in ("--lr", "--warmup-steps", "--max-steps", "--batch-size", "--grad-accum")] == [
        "0.00025", "5", "10", "2", "16"]  # 32 sequences = micro-batch 2 x 16
    large = commands("--lr", "1e-4")["gpt2-large"]
    assert [flag(large, f) for f in ("--lr", "--warmup-steps", "--batch-size")] == ["0.0001", "5", "2"]


def test_micro_batch_accumulates_to_the_global_batch():
    """--micro-batch 8 at a global batch of 32: every row accumulates 32 / (dp x 8) micro-steps times its own
    --grad-accum, so the noise row still halves the reference's micro-batch."""
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--data", "synthetic"]
    rows = {row.name: row for row in matrix(4)}

    def split(name: str) -> tuple[int, int]:
        t = parse_args(list(plan(rows[name], "gpt2-tiny", common, 32, 2, "cuda", micro_batch=8).argv)).train
        return t.batch_size, t.grad_accum

    assert split("single") == (8, 4) and split("noise") == (4, 8) and split("grad-accum") == (2, 16)
    assert split("ddp-w4") == (8, 1) and split("zero3-tp2-w4") == (8, 2)
    assert "not divisible" in plan(rows["single"], "gpt2-tiny", common, 32, 2, "cuda", micro_batch=5).skip


def curve(losses: list[float], val: float = 5.0, precision: str = "bf16") -> Curve:
    return Curve(tuple(range(1, len(losses) + 1)), tuple(losses), val, precision)


def test_compare_on_synthetic_curves():
    ref = curve([10.0, 8.0, 7.0, 6.5])
    same = compare(ref, ref, tol=0.02)
    assert same.passed and (same.max_abs_dloss, same.final_dloss, same.val_dloss, same.steps) == (0, 0, 0, 4)
    wobble = compare(ref, curve([10.0, 8.015, 6.99, 6.51], val=5.01), tol=0.02)
    assert wobble.passed and wobble.max_abs_dloss == pytest.approx(0.015) and wobble.final_dloss == pytest.approx(0.01)
    diverged = compare(ref, curve([10.0, 8.0, 7.5, 9.0]), tol=0.02)
    assert not diverged.passed and diverged.max_abs_dloss == pytest.approx(2.5)
    assert not compare(ref, curve([10.0, 8.0, 7.0, 6.5], val=5.03), tol=0.02).passed  # validation alone fails it
    assert compare(ref, curve([10.0, 8.0, 7.0, 6.75]), tol=0.25).passed  # the bound is inclusive (exact in binary)
    with pytest.raises(CurveError, match="steps differ"):
        compare(ref, curve([10.0, 8.0, 7.0]), tol=0.02)


def test_a_row_in_another_precision_is_not_judged():
    """fp32 against the bf16 reference measures what bf16 changes: verdict `precision` however far it is, while a
    bf16 row as far off fails."""
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--data", "synthetic"]
    rows = [Row("single"), Row("noise", ("--grad-accum", "2")), Row("fp32", ("--precision", "fp32")),
            Row("compile-model", ("--compile", "--compile-scope", "model"))]
    jobs = [plan(row, "gpt2-tiny", common, 8, 2, "cuda") for row in rows]
    curves = [curve([10.0, 8.0]), curve([10.0, 8.001]), curve([10.0, 8.5], precision="fp32"), curve([10.0, 8.5])]

    class Ran:  # an Outcome whose run left this curve
        def __init__(self, c: Curve) -> None:
            self.c, self.command, self.run_dir, self.exited = c, "train.py", "runs/x", True

        def curve(self) -> Curve:
            return self.c

    args = parity.parse_args(["--out", "unused"])[1]
    results, tol = parity.judge(jobs, {job: Ran(c) for job, c in zip(jobs, curves, strict=True)}, args)
    assert [r.verdict for r in results] == ["reference", "noise", "precision", "fail"]
    assert tol.value == 0.05 and results[2].comparison.max_abs_dloss == pytest.approx(0.5)


def test_tolerance_rule():
    assert tolerance(noise=0.004, factor=3, floor=0.02) == 0.02  # quiet noise: the floor
    assert tolerance(noise=0.01, factor=3, floor=0.02) == pytest.approx(0.03)  # else factor x noise
    assert tolerance(noise=None, factor=3, floor=0.02) == 0.02  # noise not measured


def test_load_curve_needs_a_finished_run(tmp_path):
    records = [{"type": "step", "step": s, "loss": 10.0 - s} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(CurveError, match="did not finish"):
        load_curve(tmp_path)
    # a train.py summary carries what tools.report.load_run requires of one (SUMMARY_KEYS)
    summary = {"type": "summary", "val_loss": 7.5, "precision": "fp32", "mode": "single", "world_size": 1,
               "batch_size_per_gpu": 2}
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(summary) + "\n")
    assert load_curve(tmp_path) == Curve((1, 2), (9.0, 8.0), 7.5, "fp32")


def _config(flags: list[str]) -> dict:
    return parse_args(["--model", "gpt2-large", *flags]).to_dict()


def test_config_key_names_the_code_path():
    # the default gather: flat tensors in units of 4 blocks (the unit resolved from the model where it was left out)
    assert config_key(_config(["--mode", "hybrid", "--compile"]), 4) == (
        "gpt2-large zero3 w4 kernels=none attn=sdpa compile=blocks ckpt=off bf16 fetch=flat unit=4 zprec=autocast")
    assert config_key(_config(["--mode", "hybrid", "--compile", "--zero3-fetch", "flat", "--zero3-unit-blocks", "4"]),
                      4).endswith(" fetch=flat unit=4 zprec=autocast")
    # a unit of blocks is another code path (hooks, graphs, flat tensors per unit); one block a unit names none, and
    # a config from before --zero3-unit-blocks gathered one block a leaf
    per_block = _config(["--mode", "hybrid", "--compile", "--zero3-fetch", "block", "--zero3-unit-blocks", "1"])
    assert config_key(per_block, 4).endswith(" fetch=block zprec=autocast")
    del per_block["parallel"]["zero3_unit_blocks"]
    assert config_key(per_block, 4).endswith(" fetch=block zprec=autocast")
    assert " unit=" not in config_key(_config(["--mode", "hybrid", "--zero3-fetch", "module"]), 4)
    # DeepSpeed's 16-bit model is another function: its own key; a config from before the flag ran that recipe
    deepspeed16 = _config(["--mode", "hybrid", "--zero-stage", "2", "--zero-precision", "deepspeed"])
    assert config_key(deepspeed16, 4).endswith("zero2 w4 kernels=none attn=sdpa compile=off ckpt=off bf16 "
                                               "zprec=deepspeed")
    del deepspeed16["parallel"]["zero_precision"]
    assert config_key(deepspeed16, 4).endswith("zprec=deepspeed")
    assert config_key(_config(["--mode", "baseline", "--tp-size", "2", "--sequence-parallel",
                               "--fused-kernels", "triton", "--activation-checkpointing"]), 2) == (
        "gpt2-large ddp-tp2-sp w2 kernels=triton attn=sdpa compile=off ckpt=on bf16 opt=triton")  # the set's AdamW
    # FSDP2: the gather dtype the run resolved (summary.json; a parity row resolves it for its device); without it,
    # as asked for, and fp32 for a config from before --fsdp2-gather; flat unit tensors (the default) named, its own
    # tensors not (the keys of the verdicts from before --fsdp2-params)
    fsdp2 = _config(["--mode", "hybrid", "--zero-engine", "fsdp2", "--compile"])
    assert config_key(fsdp2, 4, "bf16") == (
        "gpt2-large fsdp2 w4 kernels=none attn=sdpa compile=blocks ckpt=off bf16 gather=bf16 params=flat")
    assert config_key(fsdp2, 4).endswith(" gather=auto params=flat")
    del fsdp2["parallel"]["fsdp2_gather"]
    assert config_key(fsdp2, 4).endswith(" gather=fp32 params=flat")
    assert config_key(_config(["--mode", "hybrid", "--zero-engine", "fsdp2", "--fsdp2-params", "tensors"]), 4,
                      "bf16").endswith(" gather=bf16")
    row = Row("fsdp2-w4", ("--mode", "hybrid", "--zero-engine", "fsdp2", "--compile"), 4)
    common = ["--model", "gpt2-large"]
    assert plan(row, "gpt2-large", common, 32, 2, "cuda").key.endswith(" gather=bf16 params=flat wrapper=cpp")  # GPU
    assert plan(row, "gpt2-large", common, 32, 2, "cpu").key.endswith(" gather=fp32 params=flat wrapper=python")
    # the compiled graphs' host code as resolved: a verdict holds for the wrapper it ran with; eager names none
    tp = Row("zero3-tp2-w2", ("--mode", "hybrid", "--tp-size", "2", "--compile", "--compile-wrapper", "cpp"), 2)
    assert plan(tp, "gpt2-large", common, 32, 2, "cuda").key.endswith(" zprec=autocast wrapper=cpp")
    assert config_key(_config(["--compile"]), 1, compile_wrapper="python").endswith(" bf16 wrapper=python")
    assert "wrapper=" not in plan(Row("ddp-w2", ("--mode", "baseline"), 2), "gpt2-large", common, 32, 2, "cuda").key
    # batch, accumulation and learning rate do not change the code path
    assert config_key(_config(["--batch-size", "2", "--grad-accum", "4", "--lr", "1e-3"]), 1) == config_key(
        _config([]), 1)
    # another AdamW is another update: its own key, torch's keys as they were (configs from before --optimizer too)
    assert config_key(_config(["--compile", "--optimizer", "triton"]), 1).endswith(" bf16 opt=triton")
    torch_adamw = _config(["--compile"])
    assert "opt=" not in config_key(torch_adamw, 1)
    del torch_adamw["train"]["optimizer"]
    assert config_key(torch_adamw, 1) == config_key(_config(["--compile"]), 1)


def test_sweep_records_parity_and_publishes_only_passing_runs(tmp_path, monkeypatch):
    """Each sweep row gets its configuration's verdict; report.md keeps the passing runs and the HF reference."""
    def fake_launch(cmd: list[str], log_path: Path, timeout: float) -> tuple[int, float]:
        name = cmd[cmd.index("--run-name") + 1]
        run_dir = Path(cmd[cmd.index("--out-dir") + 1]) / name
        run_dir.mkdir(parents=True)
        ours = str(ROOT / "train.py") in cmd
        if ours:
            (run_dir / "config.json").write_text(json.dumps(parse_args(cmd[cmd.index(str(ROOT / "train.py")) + 1:])
                                                            .to_dict()))
        mode = cmd[cmd.index("--mode") + 1]
        (run_dir / "summary.json").write_text(json.dumps(
            {"mode": mode if ours else f"hf-{mode}", "world_size": 4, "batch_size_per_gpu": 8, "tokens_per_s": 1e3,
             "mfu": 0.1, "mem/peak_allocated_gib": 1.0, "mem/peak_reserved_gib": 1.0, "step_time_s": 1.0,
             "final_loss": 5.0, "device": "fake"}))
        log_path.write_text("ok\n")
        return 0, 1.0

    monkeypatch.setattr(train_sweep, "launch", fake_launch)
    key = {mode: config_key(_config(["--mode", mode]), 4) for mode in ("baseline", "hybrid")}
    write_csv(tmp_path / "parity.csv", [{"config": "ddp-w4", "key": key["baseline"], "verdict": "pass"},
                                        {"config": "zero3-w4", "key": key["hybrid"], "verdict": "fail"},
                                        {"config": "noise", "key": key["baseline"], "verdict": "error"}])
    sweep = ["--modes", "baseline", "hybrid", "hybrid-tp2", "hf-ddp", "--fused", "none", "--batches", "8"]
    assert train_sweep.main([*sweep, "--out", str(tmp_path / "gated"), "--parity", str(tmp_path / "parity.csv")]) == 0
    rows = read_csv(tmp_path / "gated" / "sweep.csv")
    assert [(r["run"], r["parity"]) for r in rows] == [
        ("baseline-none-b8", "pass"), ("hybrid-none-b8", "fail"), ("hybrid-tp2-none-b8", "none"),
        ("hf-ddp-b8", "n/a")]
    assert "| ok | fail |" in (tmp_path / "gated" / "sweep.md").read_text()
    report = (tmp_path / "gated" / "report.md").read_text()
    assert "| ddp |" in report and "| hf-ddp |" in report and "zero3" not in report
    assert read_verdicts([tmp_path / "parity.csv"]) == {key["baseline"]: "pass", key["hybrid"]: "fail"}
    runs = tmp_path / "gated" / "runs"  # the GPU scripts' check of run folders made outside the sweep
    assert parity_verdict.main([str(runs / "baseline-none-b8"), "--parity", str(tmp_path / "parity.csv")]) == 0
    assert parity_verdict.main([str(runs / "baseline-none-b8"), str(runs / "hybrid-none-b8"),
                                "--parity", str(tmp_path / "parity.csv")]) == 1

    assert train_sweep.main([*sweep, "--out", str(tmp_path / "ungated")]) == 0  # no --parity: nothing is checked
    assert {r["parity"] for r in read_csv(tmp_path / "ungated" / "sweep.csv")} == {"unchecked"}
    assert "zero3" in (tmp_path / "ungated" / "report.md").read_text()


def test_a_failed_torchrun_row_shows_the_worker_s_traceback_not_the_launcher_s() -> None:
    """The first H100 DeepCompile row reported only torchrun's ChildFailedError summary: the rank's RecursionError
    traceback sat above the 20 lines kept. The excerpt now ends at the worker's error line."""
    from tools.common import error_excerpt, last_error

    log = "\n".join(["$ torchrun ...", "step 1", "[rank0]: Traceback (most recent call last):",
                     '[rank0]:   File "train.py", line 3, in main',
                     "[rank0]: RecursionError: maximum recursion depth exceeded",
                     "Traceback (most recent call last):", *[f'  File "run.py", line {i}' for i in range(30)],
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "train.py FAILED"])
    assert last_error(log) == "RecursionError: maximum recursion depth exceeded"
    excerpt = error_excerpt(log, 3)
    assert excerpt == ["[rank0]: Traceback (most recent call last):", '[rank0]:   File "train.py", line 3, in main',
                       "[rank0]: RecursionError: maximum recursion depth exceeded"]
    assert error_excerpt("a\nb\nc", 2) == ["b", "c"]  # no error line: the last lines


# torchrun 2.13's summary after `os.abort()` on rank 1 (what a gloo teardown abort looks like), trimmed above it
SIGNALLED_RANK_LOG = """step 3 | loss 10.8
terminate called without an active exception
Fatal Python error: Aborted
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
tools.hf_reference FAILED
------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_04:01:15
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 18620)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 18620
======================================================"""


def test_a_rank_killed_by_a_signal_is_named_with_its_signal_not_torchrun_s_rule_line() -> None:
    """CI's sweep row read `exit 1: =====...` (torchrun's closing rule) for a rank that aborted at exit."""
    from tools.common import last_error

    assert last_error(SIGNALLED_RANK_LOG) == ("rank 1: Signal 6 (SIGABRT) received by PID 18620 "
                                              "(terminate called without an active exception)")
    # a signal outranks an earlier Python error line (one a rank printed and survived)
    assert last_error("ValueError: handled\n" + SIGNALLED_RANK_LOG).startswith("rank 1: Signal 6")
    # an exit code (train.py's 2, 65, 75): torch 2.13's traceback field only says how to enable tracebacks
    exited = SIGNALLED_RANK_LOG.replace("-6 (pid: 18620)  (SIGABRT)", "2 (pid: 18620)").replace(
        "Signal 6 (SIGABRT) received by PID 18620", "To enable traceback see: "
        "https://pytorch.org/docs/stable/elastic/errors.html")
    assert last_error(exited) == "rank 1: exitcode 2"
    assert last_error("[rank1]: RuntimeError: boom\n" + exited) == "RuntimeError: boom"  # the error line explains it
