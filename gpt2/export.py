"""Export a checkpoint of any mode as a Hugging Face GPT-2 folder (config.json + model.safetensors), fp32.

    python -m gpt2.export ckpts/step-001000 exported/          # or the save dir: its `latest` checkpoint
    python train.py --init-from exported/ ...                  # continue from it in any mode
    GPT2LMHeadModel.from_pretrained("exported/")               # or use it with transformers

single/baseline checkpoints hold the full model (model.pt); hybrid ones are DeepSpeed ZeRO shards, gathered
into one fp32 state dict by `deepspeed.utils.zero_to_fp32` (from the fp32 master weights, any stage).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from gpt2.checkpoint import LATEST, CheckpointError, read_meta
from gpt2.config import ModelConfig
from gpt2.engine_deepspeed import CHECKPOINT_TAG
from gpt2.hf_weights import hf_config_for, ours_to_hf


def _step_dir(path: Path) -> Path:
    return path / (path / LATEST).read_text().strip() if (path / LATEST).is_file() else path


def consolidated_state_dict(step_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and full fp32 state dict (our parameter names) of a checkpoint folder."""
    meta = read_meta(step_dir)
    if meta["tp_size"] != 1:
        raise CheckpointError(f"{step_dir} was saved with --tp-size {meta['tp_size']}; exporting tensor-parallel "
                              "checkpoints is not supported by this version")
    cfg = ModelConfig(**meta["model"])
    if meta["mode"] != "hybrid":
        return cfg, torch.load(step_dir / "model.pt", map_location="cpu", weights_only=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # gathering shards needs no GPU
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=CHECKPOINT_TAG)
    sd.setdefault("lm_head.weight", sd["wte.weight"])  # tied: DeepSpeed may store the parameter once
    return cfg, sd


def export_hf(checkpoint: Path, out_dir: Path) -> Path:
    """Write `out_dir` as a transformers GPT2LMHeadModel folder; returns it."""
    from transformers import GPT2LMHeadModel

    step_dir = _step_dir(checkpoint)
    cfg, sd = consolidated_state_dict(step_dir)
    with torch.device("meta"):
        hf = GPT2LMHeadModel(hf_config_for(cfg))
    hf.load_state_dict(ours_to_hf(sd, cfg), assign=True, strict=True)
    hf.tie_weights()
    hf.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt2.export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a step-XXXXXX folder or a --save-dir (its latest checkpoint)")
    p.add_argument("out_dir", type=Path, help="output folder (Hugging Face layout)")
    args = p.parse_args(argv)
    try:
        out = export_hf(args.checkpoint, args.out_dir)
    except CheckpointError as err:
        print(f"gpt2.export: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {_step_dir(args.checkpoint)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
