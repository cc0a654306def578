"""Launch train.py as users do (python / torchrun subprocesses) and read back what the run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import free_port

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
TINY_ARGS = ["--model", "gpt2-tiny", "--seq-len", "32", "--warmup-steps", "2", "--log-interval", "1",
             "--wandb", "disabled", "--precision", "fp32", "--device", "cpu"]


def train_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
               WANDB_SILENT="true")
    return env


def run_train(args: list[str], out_dir: Path, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run train.py (under torchrun when nproc > 1); raises with the output if it fails."""
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", str(ROOT / "train.py")]
    proc = subprocess.run(cmd + args + ["--out-dir", str(out_dir)], capture_output=True, text=True,
                          env=train_env(), timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> list[float]:
    return step_values(run_dir, "loss")


def step_values(run_dir: Path, key: str) -> list[float]:
    """`key` ("loss", "grad_norm", ...) of every logged training step, in order."""
    return [r[key] for r in read_records(run_dir) if r["type"] == "step" and key in r]


def summary(run_dir: Path) -> dict:
    return next(r for r in read_records(run_dir) if r["type"] == "summary")


def assert_hf_export_matches(cfg, state_dict: dict, hf_dir: Path):
    """The exported Hugging Face folder computes our model's logits on `state_dict` (fp32, 1e-5).

    Returns (our model, the HF model), both in eval mode, for further checks."""
    import torch
    from transformers import GPT2LMHeadModel

    from gpt2.model import GPT

    ours = GPT(cfg).eval()
    ours.load_state_dict(state_dict)
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), atol=1e-5, rtol=1e-5)
    return ours, hf
