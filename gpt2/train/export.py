"""Export a checkpoint of any mode as a Hugging Face GPT-2 folder (config.json + model.safetensors), fp32.

    python -m gpt2.train.export ckpts/step-001000 exported/          # or the save dir: its `latest` checkpoint
    python train.py --init-from exported/ ...                  # continue from it in any mode
    GPT2LMHeadModel.from_pretrained("exported/")               # or use it with transformers

single/baseline checkpoints hold the full model (model.pt); hybrid ones are DeepSpeed ZeRO shards, gathered
into one fp32 state dict by `deepspeed.utils.zero_to_fp32` (from the fp32 master weights, any stage), or, with
--zero-engine fsdp2, torch.distributed.checkpoint shards read back whole on the CPU
(`gpt2.engines.fsdp2_engine.read_model_state`). A --zero3-fetch flat checkpoint's flat block tensors are split
back into our parameter names by the layout it holds (`gpt2.runtime.flat_blocks.unflatten_state_dict`), and a
--zero3-unit-blocks checkpoint's unit names into block names (`gpt2.runtime.block_units.ungroup_state_dict`).

Tensor-parallel checkpoints are saved in the TP layout (no gather at save time, so saving costs no extra
memory or communication) and consolidated here, on the CPU: first each TP rank's state dict (its
model-tpXX.pt, or its DeepSpeed files, those named `mp_rank_XX`, through zero_to_fp32), then every tensor
is reassembled from the TP ranks' shards by the TP plan (`parallel.tp_plan.unshard_tensor`).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError

from gpt2.config.cli import check_folder_creatable
from gpt2.config.schema import ConfigError, ModelConfig
from gpt2.engines.base import CHECKPOINT_TAG, state_file
from gpt2.model.hf_weights import hf_config_for, ours_to_hf
from gpt2.runtime.block_units import ungroup_state_dict
from gpt2.runtime.flat_blocks import read_layout, unflatten_state_dict
from gpt2.train.checkpoint import EXIT_SAVE_FAILED, LATEST, CheckpointError, read_meta, verify_checkpoint
from gpt2.train.preemption import EXIT_INTERRUPTED
from parallel.tp_plan import param_shard, unshard_tensor

EXIT_TERMINATED = 128 + signal.SIGTERM  # a shell's status for a process SIGTERM ended


def _step_dir(path: Path) -> Path:
    return path / (path / LATEST).read_text().strip() if (path / LATEST).is_file() else path


def _zero_fp32_state_dict(step_dir: Path) -> dict[str, torch.Tensor]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # gathering shards needs no GPU
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=CHECKPOINT_TAG)
    sd.setdefault("lm_head.weight", sd["wte.weight"])  # tied: DeepSpeed may store the parameter once
    return sd


def _zero_tp_rank_state_dict(step_dir: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    """One TP rank's fp32 state dict (TP layout) from a ZeRO checkpoint of several TP ranks.

    zero_to_fp32 consolidates over data-parallel ranks only and expects the files of TP rank 0, so it reads
    a temporary folder of links to this rank's files, renamed from `mp_rank_XX` to `mp_rank_00`.
    """
    ours, as_rank0 = f"mp_rank_{tp_rank:02d}", "mp_rank_00"
    files = [f for f in (step_dir / CHECKPOINT_TAG).iterdir() if ours in f.name]
    if not files:
        raise CheckpointError(f"{step_dir / CHECKPOINT_TAG} has no files of TP rank {tp_rank} (*{ours}*)")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / CHECKPOINT_TAG).mkdir()
        for f in files:
            (Path(tmp) / CHECKPOINT_TAG / f.name.replace(ours, as_rank0)).symlink_to(f.resolve())
        return _zero_fp32_state_dict(Path(tmp))


def consolidated_state_dict(step_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and full fp32 state dict (our parameter names) of a checkpoint folder."""
    meta = read_meta(step_dir)
    verify_checkpoint(step_dir)  # before DeepSpeed's loader unpickles anything
    cfg = ModelConfig(**meta["model"])
    tp = meta["tp_size"]
    if meta.get("zero_engine") == "fsdp2":  # torch.distributed.checkpoint folders, one per TP rank
        from gpt2.engines.fsdp2_engine import read_model_state

        shards = [read_model_state(step_dir, r) for r in range(tp)]
        if meta.get("fsdp2_params") == "flat":  # each unit's flat tensors -> blocks.U.layers.J -> blocks.N
            layout = read_layout(step_dir)
            shards = [ungroup_state_dict(unflatten_state_dict(sd, layout), meta["fsdp2_unit_blocks"])
                      for sd in shards]
        for sd in shards:
            sd.setdefault("lm_head.weight", sd["wte.weight"])  # tied: one tensor, whichever key it is kept under
        if tp == 1:
            return cfg, shards[0]
    elif meta["mode"] == "hybrid":
        shards = [_zero_fp32_state_dict(step_dir)] if tp == 1 else [_zero_tp_rank_state_dict(step_dir, r)
                                                                    for r in range(tp)]
        if meta.get("zero3_flat"):  # --zero3-fetch flat: each TP rank's flat tensors -> our names (by its layout)
            layout = read_layout(step_dir)
            shards = [unflatten_state_dict(sd, layout) for sd in shards]
        if meta.get("zero3_unit_blocks", 1) > 1:  # --zero3-unit-blocks: blocks.U.layers.J -> blocks.N
            shards = [ungroup_state_dict(sd, meta["zero3_unit_blocks"]) for sd in shards]
        if tp == 1:
            return cfg, shards[0]
    else:
        shards = [torch.load(state_file(step_dir, "model", r, tp), map_location="cpu", weights_only=True)
                  for r in range(tp)]
        if tp == 1:
            return cfg, shards[0]
    return cfg, {key: unshard_tensor([s[key] for s in shards], param_shard(key)) for key in shards[0]}


class ExportTargetError(Exception):
    """The output folder holds something already: exporting into it would overwrite the user's files."""


def check_out_dir(out_dir: Path, checkpoint: Path) -> None:
    """Refuse an existing non-empty folder (or a file): save_pretrained would silently replace its files; one inside
    the checkpoint (or save dir) it reads, whose manifest check the new files would fail; and one that cannot be
    created or written (found only after the gather otherwise)."""
    source = checkpoint.resolve()
    if out_dir.resolve() == source or source in out_dir.resolve().parents:
        raise ExportTargetError(f"output folder {out_dir} is inside the checkpoint {checkpoint} being exported (its "
                                "files would no longer match its manifest); nothing was written. Choose a folder "
                                "outside it.")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportTargetError(f"output folder {out_dir} exists and is not empty; nothing was written. "
                                "Choose a new or empty folder.")
    try:
        check_folder_creatable("output folder", out_dir)
    except ConfigError as err:
        raise ExportTargetError(f"{err}; nothing was written") from None


def _partial_prefix(out_dir: Path) -> str:
    """The name an export's temporary folder starts with, followed by the exporting process's id."""
    return f".{out_dir.name}.export-"


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_abandoned_exports(out_dir: Path) -> None:
    """Remove the temporary folders of exports to `out_dir` whose process is gone (SIGKILL, power loss): each is a
    partial copy of a model, so they would keep a disk full."""
    prefix = _partial_prefix(out_dir)
    for partial in out_dir.parent.glob(f"{glob.escape(prefix)}*"):
        pid = partial.name[len(prefix):].partition("-")[0]
        if partial.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


class Terminated(BaseException):
    """SIGTERM during an export: raised where the export is, so that its temporary folder is removed."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def export_hf(checkpoint: Path, out_dir: Path) -> Path:
    """Write `out_dir` (new or empty) as a transformers GPT2LMHeadModel folder; returns it."""
    check_out_dir(out_dir, checkpoint)  # before the gather, which can take minutes and much memory
    from transformers import GPT2LMHeadModel

    step_dir = _step_dir(checkpoint)
    cfg, sd = consolidated_state_dict(step_dir)
    with torch.device("meta"):
        hf = GPT2LMHeadModel(hf_config_for(cfg))
    hf.load_state_dict(ours_to_hf(sd, cfg), assign=True, strict=True)
    hf.tie_weights()
    # written beside it and renamed: a stop mid-write (Ctrl-C, SIGTERM, disk full) leaves no partial out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_exports(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_partial_prefix(out_dir)}{os.getpid()}-", dir=out_dir.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would keep the export from everyone else
        hf.save_pretrained(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty (check_out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt2.train.export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a step-XXXXXX folder or a --save-dir (its latest checkpoint)")
    p.add_argument("out_dir", type=Path, help="output folder (Hugging Face layout)")
    args = p.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        out = export_hf(args.checkpoint, args.out_dir)
    except (CheckpointError, ExportTargetError) as err:
        print(f"gpt2.train.export: error: {err}", file=sys.stderr)
        return 2
    except (OSError, SafetensorError) as err:  # the write itself (disk full): the temporary folder is gone
        print(f"gpt2.train.export: error: writing {args.out_dir} failed ({err}); nothing was written", file=sys.stderr)
        return EXIT_SAVE_FAILED
    except KeyboardInterrupt:
        print(f"gpt2.train.export: interrupted (Ctrl-C); {args.out_dir} was not written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"gpt2.train.export: stopped by SIGTERM; {args.out_dir} was not written", file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"exported {_step_dir(args.checkpoint)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
