"""The non-finite guard (gpt2/engines/guard.py): faults injected into real training
(`GPT2_TEST_NONFINITE=KIND@STEPS[/RANK]`,
test-only) and what each must leave behind. `loss` makes a step's loss NaN with finite gradients (the case an
unguarded optimizer applies silently); `grad` keeps the loss finite and makes the gradients infinite.

Each fault tried and the outcome asserted:

- one `loss` or `grad` step, in-process (single, fp32): parameters, AdamW moments and step counts are bit-identical
  to those before it, the LR schedule moves on one step, and the next step is applied again; three in a row trip
  the guard, which then skips a clean step too and raises NonFiniteError naming the steps.
- fp16 counting (guard alone): loss-scale overflows (finite loss) are skipped but not counted; non-finite losses are.
- a real single run, `loss@3,grad@6-8`, --max-bad-steps 3, --save-interval 1 --keep-last 1: step 3 is skipped and
  training continues (its save waits for step 4); steps 6-8 stop the run with exit 65 and a message naming the steps
  and --lr; no checkpoint after step 5 exists and --keep-last kept step 5, whose weights are finite.
- the same faults on rank 1 only of a 2-rank ZeRO-3 run (2 gloo ranks), DeepSpeed's and FSDP2's: rank 0's own numbers
  are finite, yet both ranks skip the same steps (DeepSpeed's skip or the fused AdamW's, our gate and schedule
  step), keep the single run's losses and gradient norms (tests/integration/test_zero.py's tolerances) and stop
  together with exit 65; the save dir ends as the single run's.
- a DeepSpeed config that turns off the checks the guard relies on is refused.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from gpt2.config.cli import parse_args
from gpt2.config.deepspeed_file import build_ds_config
from gpt2.config.layout import RunLayout
from gpt2.config.schema import ConfigError
from gpt2.data.loader import build_data
from gpt2.engines.base import lr_at
from gpt2.engines.build import build_engine
from gpt2.engines.guard import (
    EXIT_NONFINITE,
    FAULT_ENV,
    GuardReading,
    NonFiniteError,
    NonFiniteGuard,
    install_fault_injection,
)
from gpt2.engines.torch_engine import TorchEngine
from gpt2.planning.planner import plan_for_run
from gpt2.runtime.distributed import init_distributed
from gpt2.train.checkpoint import Checkpointer
from gpt2.train.loop import train_step
from tests.train_runs import ROOT, TINY_ARGS, read_records, train_command, train_env

ARGS = TINY_ARGS + ["--data", "synthetic", "--max-steps", "10", "--seed", "7", "--eval-batches", "1",
                    "--max-bad-steps", "3", "--save-interval", "1", "--keep-last", "1"]
FAULTS = "loss@3,grad@6-8"


def _state(engine: TorchEngine) -> dict[str, dict]:
    return copy.deepcopy({"model": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()["state"]})


def _same(a: dict, b: dict) -> bool:
    """Nested dicts of tensors, bit-identical."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b)


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_a_nonfinite_step_updates_nothing_and_a_tripped_guard_nothing_more(kind: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, f"{kind}@3,{kind}@5-7")
    cfg = parse_args(TINY_ARGS + ["--data", "synthetic", "--batch-size", "2", "--max-steps", "8", "--seed", "3"])
    layout, ctx = init_distributed(cfg)  # single: no process group
    data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                      model_vocab_size=cfg.model.vocab_size, dp_rank=0, dp_size=1, seed=cfg.train.seed, is_main=True,
                      barrier=ctx.barrier)
    engine = build_engine(layout, ctx)
    install_fault_injection(engine.module, layout.grad_accum, 0, ctx.rank)

    def step(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, _, norm = train_step(layout, ctx, engine, data)
        engine.guard.record(n, loss_sum, norm)
        return loss_sum, norm

    step(1), step(2)
    before = _state(engine)
    loss_sum, norm = step(3)
    assert not math.isfinite(norm.item()) and math.isfinite(loss_sum.item()) is (kind == "grad")
    assert _same(_state(engine), before)  # weights, moments and step counts as before the bad step
    assert engine.scheduler.last_epoch == 3 and engine.lr == pytest.approx(lr_at(2, cfg.train))
    reading = engine.guard.check(3, ctx)
    assert (reading.streak, reading.skipped, reading.tripped_at, reading.last_skipped) == (1, 1, 0, 3)
    loss_sum, norm = step(4)
    assert math.isfinite(norm.item()) and math.isfinite(loss_sum.item())
    assert not _same(_state(engine)["model"], before["model"])  # applied again
    assert engine.guard.check(4, ctx).streak == 0

    before = _state(engine)
    for n in (5, 6, 7, 8):  # 5-7 bad: the guard trips at 7 and latches, so the clean step 8 is skipped too
        step(n)
    assert _same(_state(engine), before)
    reading = engine.guard.check(8, ctx)
    assert (reading.streak, reading.skipped, reading.tripped_at) == (4, 5, 7)
    with pytest.raises(NonFiniteError, match=r"at 3 consecutive steps \(5-7; --max-bad-steps 3\); stopped at step 8"):
        engine.guard.raise_if_tripped(reading, 8)


def test_a_checkpoint_of_non_finite_weights_is_refused(tmp_path: Path) -> None:
    """The save itself checks the weights: an update the guard let through (finite loss and gradient norm, an
    infinite step) is never checkpointed, and the message names the newest checkpoint."""
    cfg = parse_args(TINY_ARGS + ["--data", "synthetic", "--batch-size", "2", "--max-steps", "4",
                                  "--save-dir", str(tmp_path / "ck")])
    layout, ctx = init_distributed(cfg)
    data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                      model_vocab_size=cfg.model.vocab_size, dp_rank=0, dp_size=1, seed=cfg.train.seed, is_main=True,
                      barrier=ctx.barrier)
    engine = build_engine(layout, ctx)
    checkpointer = Checkpointer(layout, ctx, engine, data.train, plan_for_run(layout).checkpoint_bytes)
    checkpointer.save(1)
    with torch.no_grad():
        next(engine.module.parameters())[0, 0] = math.inf
    with pytest.raises(NonFiniteError, match=r"after step 2 hold non-finite values.*newest checkpoint: .*step-000001"):
        checkpointer.save(2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-000001"]


def test_fp16_counts_a_non_finite_loss_not_a_loss_scale_overflow() -> None:
    """In fp16 a finite loss with overflowing gradients is skipped (the scaler lowers the scale) but not counted:
    loss-scale calibration may take several such steps in a row."""
    ctx = init_distributed(parse_args(TINY_ARGS))[1]
    guard = NonFiniteGuard(2, torch.device("cpu"), counts_grad_overflow=False, advice="")
    finite, inf = torch.tensor(1.0), torch.tensor(float("inf"))
    for n in (1, 2, 3):
        guard.record(n, finite, inf)
    assert guard.check(3, ctx) == GuardReading(streak=0, skipped=3, tripped_at=0, last_skipped=3)
    guard.record(4, inf, inf)
    guard.record(5, inf, inf)
    assert guard.check(5, ctx) == GuardReading(streak=2, skipped=5, tripped_at=5, last_skipped=5)


def test_the_periodic_check_is_read_one_step_later_with_the_counters_of_its_step() -> None:
    """start_check after step 3 queues the counters as of step 3; finish_check after step 4 returns them (not step
    4's), once; then nothing is pending."""
    ctx = init_distributed(parse_args(TINY_ARGS))[1]
    guard = NonFiniteGuard(2, torch.device("cpu"), counts_grad_overflow=True, advice="")
    finite, inf = torch.tensor(1.0), torch.tensor(float("inf"))
    assert guard.finish_check(ctx) is None
    guard.record(1, finite, finite)
    guard.record(2, inf, inf)
    guard.record(3, inf, inf)
    guard.start_check(3, ctx)
    guard.record(4, finite, finite)
    assert guard.finish_check(ctx) == GuardReading(streak=2, skipped=2, tripped_at=3, last_skipped=3)
    assert guard.finish_check(ctx) is None


def _faulty_run(args: list[str], out: Path, faults: str, nproc: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run([*train_command(nproc), *args, "--out-dir", str(out)],
                          capture_output=True, text=True, env=train_env() | {FAULT_ENV: faults}, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path_factory.mktemp("nonfinite")
    args = ARGS + ["--batch-size", "4", "--run-name", "single", "--save-dir", str(root / "ck")]
    return _faulty_run(args, root, FAULTS), root


def _steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_records(run_dir) if r["type"] == "step" and "loss" in r}


def test_single_run_skips_bad_steps_and_stops_after_three_in_a_row(single) -> None:
    proc, root = single
    assert proc.returncode == EXIT_NONFINITE, proc.stderr[-3000:]
    assert ("not finite at 3 consecutive steps (6-8; --max-bad-steps 3); stopped at step 8" in proc.stderr
            and "lower --lr" in proc.stderr and f"exit {EXIT_NONFINITE}" in proc.stderr), proc.stderr[-3000:]
    steps = _steps(root / "single")
    assert sorted(steps) == list(range(1, 9))
    assert steps[3]["loss"] is None and steps[3]["grad_norm"] is None  # NaN in JSON: null
    for n in (1, 2, 4, 5):  # training went on after the single bad step
        assert math.isfinite(steps[n]["loss"]) and math.isfinite(steps[n]["grad_norm"]), n
    assert all(steps[n]["grad_norm"] is None and math.isfinite(steps[n]["loss"]) for n in (6, 7, 8))
    assert [steps[n]["skipped_steps"] for n in range(1, 9)] == [0, 0, 1, 1, 1, 2, 3, 4]
    t = parse_args(ARGS + ["--save-dir", str(root / "ck")]).train
    assert steps[4]["lr"] == pytest.approx(lr_at(3, t))  # a skipped step used up its point on the schedule
    assert "checkpoint of step 3 postponed" in proc.stderr


def test_no_checkpoint_holds_or_follows_a_bad_step_and_keep_last_keeps_the_good_one(single) -> None:
    _, root = single
    ck = root / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000005"]
    assert (ck / "latest").read_text().strip() == "step-000005"
    weights = torch.load(ck / "step-000005" / "model.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.slow
@pytest.mark.parametrize(("name", "engine"), [("zero3", ["--zero-stage", "3"]), ("fsdp2", ["--zero-engine", "fsdp2"])])
def test_zero3_ranks_skip_and_stop_together_on_one_rank_s_fault(single, tmp_path: Path, name: str,
                                                                 engine: list[str]) -> None:
    """The faults hit rank 1 only: the gate turns its gradients NaN, the ZeRO gradient reduction (DeepSpeed's, or
    FSDP2's reduce-scatter) carries that to rank 0, and both ranks skip, count and stop at the same steps, as the
    single run did."""
    proc, root = single
    args = ARGS + ["--mode", "hybrid", *engine, "--batch-size", "2", "--run-name", name,
                   "--save-dir", str(tmp_path / "ck")]
    faults = ",".join(f"{fault}/1" for fault in FAULTS.split(","))
    zero = _faulty_run(args, tmp_path, faults, nproc=2)
    assert zero.returncode != 0 and f"exitcode  : {EXIT_NONFINITE}" in zero.stderr, zero.stderr[-3000:]
    ours, theirs = _steps(tmp_path / name), _steps(root / "single")
    assert sorted(ours) == sorted(theirs)
    for n, record in ours.items():
        for key, rel in (("loss", 1e-5), ("grad_norm", 2e-4)):  # tests/integration/test_zero.py's tolerances
            want = theirs[n][key]
            assert record[key] is None if want is None else record[key] == pytest.approx(want, rel=rel), (n, key)
        assert record["skipped_steps"] == theirs[n]["skipped_steps"] and record["lr"] == theirs[n]["lr"], n
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-000005"]


@pytest.mark.parametrize("setting", [{"bf16": {"check_grad_overflow": False}},
                                     {"zero_optimization": {"compute_grad_norm": False}}])
def test_deepspeed_config_cannot_turn_off_the_checks_the_guard_needs(setting: dict, tmp_path: Path) -> None:
    cfg = parse_args(["--mode", "hybrid", "--zero-stage", "2", "--precision", "bf16"])
    layout = RunLayout.resolve(cfg, 2, torch.device("cuda"))
    ds = build_ds_config(layout)
    assert ds["bf16"]["check_grad_overflow"] and ds["zero_optimization"]["compute_grad_norm"]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(setting))
    cfg.parallel.ds_config = str(path)
    with pytest.raises(ConfigError, match="=false but the non-finite guard"):
        build_ds_config(RunLayout.resolve(cfg, 2, torch.device("cuda")))
