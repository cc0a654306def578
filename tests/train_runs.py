"""Launch train.py as users do (python / torchrun subprocesses) and read back what the run wrote."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tools.common import torchrun

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
TINY_ARGS = ["--model", "gpt2-tiny", "--seq-len", "32", "--warmup-steps", "2", "--log-interval", "1",
             "--wandb", "disabled", "--precision", "fp32", "--device", "cpu"]
# The session reference's flags (tests/conftest.py), shared by every run compared with it: lr 3e-3 on 8 repeated
# synthetic blocks, so the loss falls (10.84 -> 9.44 in 10 steps) and the gradient clip (1.0) is active on most
# steps: a wrong gradient shows.
REFERENCE_STEPS = 10
REFERENCE_ARGS = TINY_ARGS + ["--data", "synthetic", "--max-steps", str(REFERENCE_STEPS), "--seed", "3",
                              "--eval-batches", "2", "--lr", "3e-3", "--max-samples", "8"]
REFERENCE_BATCH = 4  # sequences per optimizer step: the global batch of every run compared with the reference
NEVER_CREATED = Path(tempfile.gettempdir()) / "gpt2-never-created"  # a run that fails at start-up leaves it absent; its
# parent is writable, so the start-up check of --out-dir passes for any user
LOSS_REL_TOL = 1e-5  # per-step loss vs the reference: only the reduction order differs (fp32)


@dataclass(frozen=True)
class ReferenceRun:
    """A `--mode single --batch-size 4` run that others are compared with (`train_reference`)."""

    run_dir: Path  # its metrics.jsonl, console.log, ...
    save_dir: Path  # its checkpoint of the last step

    @property
    def checkpoint(self) -> Path:
        return self.save_dir / f"step-{REFERENCE_STEPS:06d}"


def train_reference(root: Path, args: list[str] = REFERENCE_ARGS, env: dict[str, str] | None = None) -> ReferenceRun:
    """`--mode single --batch-size 4` with `args` (REFERENCE_STEPS steps) in `env`, its last step saved."""
    ref = ReferenceRun(run_dir=root / "single", save_dir=root / "ck-single")
    run_train(args + ["--batch-size", str(REFERENCE_BATCH), "--run-name", "single", "--save-dir", str(ref.save_dir)],
              root, env=env)
    return ref


def train_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
               WANDB_SILENT="true")
    return env


def gpu_train_env() -> dict[str, str]:
    """train_env for runs on GPUs: DeepSpeed picks its CUDA accelerator; NVLink multicast stays off."""
    env = {k: v for k, v in train_env().items() if k != "DS_ACCELERATOR"}
    env["NCCL_NVLS_ENABLE"] = "0"
    return env


def train_command(nproc: int) -> list[str]:
    """train.py's command line up to its flags: a plain process for one, torchrun for more."""
    return [*([sys.executable] if nproc == 1 else torchrun(nproc)), str(ROOT / "train.py")]


def run_train(args: list[str], out_dir: Path, nproc: int = 1, timeout: int = 300,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run train.py (under torchrun when nproc > 1) in `env` (default: train_env()); raises with the output if it
    fails. In train_env(), unless GPT2_TEST_FORK=0, the ranks are forked from a server that has imported
    torch (tests/_fork_launch.py: the variables torchrun sets, no torchrun process, no per-rank imports)."""
    train_args = args + ["--out-dir", str(out_dir)]
    if env is None and forking():
        proc = fork_server(_flavour(args)).run(train_args, nproc, timeout)
    else:
        proc = subprocess.run(train_command(nproc) + train_args, capture_output=True, text=True,
                              env=train_env() if env is None else env, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)  # changes every test: not an import-time setting


def _stable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE_ENV}


def _flavour(args: list[str]) -> str:
    """'deepspeed' for a DeepSpeed ZeRO run (its server has imported deepspeed too), else 'base'."""
    from gpt2.config.cli import parse_args

    try:
        cfg = parse_args(args)
    except BaseException:  # a run meant to fail at its arguments fails the same way in either server
        return "base"
    return "deepspeed" if cfg.train.mode == "hybrid" and cfg.parallel.zero_engine == "deepspeed" else "base"


class _ForkServer:
    """tests/_fork_launch.py's server for this pytest process, started in train_env() (restarted if that changes)."""

    def __init__(self, flavour: str):
        self.flavour, self.env = flavour, _stable(train_env())
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's life) its imports' warnings
        self.proc = subprocess.Popen([sys.executable, "-m", "tests._fork_launch", flavour], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=train_env(), cwd=ROOT, text=True)
        ready = self.proc.stdout.readline()
        if ready.strip() != json.dumps({"ready": flavour}):
            self.log.seek(0)
            raise AssertionError(f"fork server did not start: {ready!r}\n{self.log.read().decode()[-5000:]}")

    def usable(self) -> bool:
        return self.proc.poll() is None and _stable(train_env()) == self.env

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # a server killed mid-launch (launch) has no reader
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()

    def launch(self, args: list[str], nproc: int, timeout: int, stdout: Path, stderr: Path,
               runtime_env: dict[str, str] | None = None, script: Path = ROOT / "train.py") -> dict:
        """Train with `args` on `nproc` forked ranks, their output appended to `stdout` / `stderr` (one path: both).
        `runtime_env`: variables the run reads once it runs (not at import), set over train_env(); `script`: another
        entry point (the launcher's own test). Returns the server's answer: rc (torchrun's for nproc > 1; for one,
        the process's status, negative: killed by that signal), each rank's status, whether it timed out."""
        request = {"args": args, "nproc": nproc, "env": train_env() | (runtime_env or {}), "cwd": str(ROOT),
                   "timeout": timeout, "script": str(script), "stdout": str(stdout), "stderr": str(stderr)}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        except BaseException:  # e.g. pytest-timeout mid-launch: this launch's answer would reach the next one
            self.proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG); the next launch starts a new server
            raise
        assert answer, f"fork server exited ({self.proc.poll()})"
        return json.loads(answer)

    def run(self, args: list[str], nproc: int, timeout: int) -> subprocess.CompletedProcess:
        """`launch` as subprocess.run(train.py's command, capture_output=True) answers: output, status, timeout."""
        cmd = train_command(nproc) + args
        with tempfile.TemporaryDirectory(prefix="gpt2-launch-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            result = self.launch(args, nproc, timeout, out, err)
            stdout, stderr = (p.read_text() if p.exists() else "" for p in (out, err))
        if result["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, result["rc"], stdout, stderr)


def forking() -> bool:
    """Whether launches fork from tests/_fork_launch.py's server (GPT2_TEST_FORK=0: fresh interpreters)."""
    return os.environ.get("GPT2_TEST_FORK", "1") != "0"


def forked_launch(args: list[str], log: Path, runtime_env: dict[str, str], timeout: int = 300) -> int | None:
    """One train.py process forked from the server (see _ForkServer.launch), stdout and stderr to `log`; its exit
    status (negative: the signal that killed it), or None when it timed out (killed)."""
    result = fork_server(_flavour(args)).launch(args, 1, timeout, log, log, runtime_env)
    return None if result["timed_out"] else result["rc"]


_SERVERS: dict[str, _ForkServer] = {}


def fork_server(flavour: str) -> _ForkServer:
    server = _SERVERS.get(flavour)
    if server is None or not server.usable():
        if server is not None:
            server.close()
        server = _SERVERS[flavour] = _ForkServer(flavour)
    return server


def train_error(argv: list[str], capsys, out_dir: Path = NEVER_CREATED) -> str:
    """train.main in-process for a run that must fail at start-up (exit 2); returns its stderr. In-process: no
    interpreter to start, and the failure comes before any model, data or process group is made."""
    from train import main

    assert main(argv + ["--out-dir", str(out_dir)]) == 2
    return capsys.readouterr().err


def first_batch_loss(model, args: list[str]) -> float:
    """`model`'s loss (fp32, no grad) on the first training batch of a one-process run with `args` (its step 1's
    batch; dp ranks split this global batch): what a run that starts from `model`'s weights logs at step 1."""
    import torch

    from gpt2.config.cli import parse_args
    from gpt2.data.loader import build_data

    cfg = parse_args(args)
    data = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                      model_vocab_size=cfg.model.vocab_size, dp_rank=0, dp_size=1, seed=cfg.train.seed, is_main=True,
                      barrier=lambda: None)
    x, y = data.train.next_batch()
    with torch.no_grad():
        return model(x, y)[0].item()


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_killed_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a run that may have been SIGKILLed (none if it never wrote one): only its last line may be
    cut, and that line is left out."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            assert i == len(lines) - 1, (run_dir.name, line)
    return out


def step_losses(run_dir: Path) -> list[float]:
    return step_values(run_dir, "loss")


def step_values(run_dir: Path, key: str) -> list[float]:
    """`key` ("loss", "grad_norm", ...) of every logged training step, in order."""
    return [r[key] for r in read_records(run_dir) if r["type"] == "step" and key in r]


def summary(run_dir: Path) -> dict:
    return next(r for r in read_records(run_dir) if r["type"] == "summary")


def by_collective(record: dict, prefix: str) -> dict[str, float]:
    """A summary's `prefix<collective>` entries (e.g. "plan/dp_payload_bytes/"), by collective."""
    return {k.removeprefix(prefix): v for k, v in record.items() if k.startswith(prefix)}


def assert_matches_reference(ref: ReferenceRun, run_dir: Path, grad_norm_rel_tol: float,
                             loss_rel_tol: float = LOSS_REL_TOL) -> None:
    """A run with the reference's flags trains its function: per-step loss within `loss_rel_tol` and pre-clip
    gradient norm within `grad_norm_rel_tol` (relative), over every one of its REFERENCE_STEPS steps."""
    for key, rel_tol in (("loss", loss_rel_tol), ("grad_norm", grad_norm_rel_tol)):
        want, got = step_values(ref.run_dir, key), step_values(run_dir, key)
        assert len(want) == len(got) == REFERENCE_STEPS, (key, len(want), len(got))
        for step, (a, b) in enumerate(zip(want, got), start=1):
            assert abs(a - b) <= rel_tol * abs(a), f"{run_dir.name} {key} step {step}: single {a} vs {b}"


def assert_resume_exact(full: Path, resumed: Path, at: int, keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    """The run resumed from `full`'s step-`at` checkpoint logs `full`'s later steps (<= 1e-6 absolute)."""
    for key in keys:
        a_all, b_all = step_values(full, key), step_values(resumed, key)
        assert len(b_all) == len(a_all) - at, (key, len(a_all), len(b_all))
        for step, (a, b) in enumerate(zip(a_all[at:], b_all), start=at + 1):
            assert abs(a - b) <= 1e-6, f"{key} step {step}: uninterrupted {a} vs resumed {b}"


def assert_weights_match(step_dir: Path, reference_step_dir: Path, atol: float):
    """The exported (consolidated, fp32) weights of two checkpoints agree within `atol`; returns the first's model
    config and state dict."""
    import torch

    from gpt2.train.export import consolidated_state_dict

    cfg, ours = consolidated_state_dict(step_dir)
    theirs = consolidated_state_dict(reference_step_dir)[1]
    off = [k for k in theirs if k not in ours or not torch.allclose(ours[k], theirs[k], atol=atol, rtol=0)]
    assert set(ours) == set(theirs) and not off, f"{step_dir} vs {reference_step_dir}: {off} (atol {atol})"
    return cfg, ours


def assert_hf_export_matches(cfg, state_dict: dict, hf_dir: Path):
    """The exported Hugging Face folder computes our model's logits on `state_dict` (fp32, 1e-5).

    Returns (our model, the HF model), both in eval mode, for further checks."""
    import torch
    from transformers import GPT2LMHeadModel

    from gpt2.model.gpt import GPT

    ours = GPT(cfg).eval()
    ours.load_state_dict(state_dict)
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), atol=1e-5, rtol=1e-5)
    return ours, hf
