"""Checkpoints for every mode: atomic step folders, a `latest` pointer, exact resume, errors that name the fix.

Layout of `--save-dir`::

    latest                  "step-000020": the newest complete checkpoint, replaced atomically after its rename
    step-000010/
      manifest.json         size and sha256 of every other file in the folder (written last)
      meta.json             model config, mode, world/tp/dp sizes, zero stage, step, versions
      rank-00000.pt ...     per rank: RNG states (torch CPU + CUDA, numpy, python) and the train data position
      model.pt              single/baseline: model state dict (rank 0; DDP replicas are identical)
      optimizer.pt          single/baseline: AdamW, LR scheduler and GradScaler states (rank 0)
      model-tp00.pt ...     baseline with --tp-size > 1: the same two files per TP rank, in the TP layout
      optimizer-tp00.pt ... (written by data-parallel rank 0 of each TP rank; `gpt2.train.export` gathers them)
      zero/                 hybrid: DeepSpeed's sharded checkpoint (engine.save_checkpoint, tag "zero"; with
                            TP its files carry the TP rank as DeepSpeed's `mp_rank_XX`)
      fsdp2/tp00/ ...       hybrid, --zero-engine fsdp2: torch.distributed.checkpoint's shards of each TP rank's model
                            and optimizer, + fsdp2/schedule.pt (gpt2.engines.fsdp2_engine)
    step-000020.tmp/        a save in progress, or one a crash interrupted: never read, removed by the next save
    latest.pending          "step-000020": written just before the rename, removed once `latest` names it
    step-000004.deleting/   a --keep-last deletion in progress (renamed first): never read, removed by the next save

A save writes everything into `step-XXXXXX.tmp/`, fsyncs it, records the name in `latest.pending`, renames the
folder to `step-XXXXXX/` and only then points `latest` at it and removes `latest.pending`. A kill at any instant
leaves a resumable save dir: before the rename `latest` still names the previous checkpoint; after it, a
`latest.pending` that names a complete folder newer than `latest` wins (a warning says so), so the requeued job
continues from the newest complete checkpoint; its first save points `latest` there before it writes
`latest.pending` again. A complete step folder that neither names (another branch of the
run) is never chosen by `--resume auto`. `--keep-last` renames a folder to `step-XXXXXX.deleting` before deleting
it, so a kill mid-delete leaves nothing a resume could pick. An existing
step folder is never overwritten, and a `--save-dir` holding another run's checkpoints is refused unless this
run resumes from it; `--keep-last` deletes only checkpoints older than the one just written. Resume restores
model, optimizer, scheduler, step, data position and RNG states, so N steps + resume + M steps give the losses
of N + M uninterrupted steps. A checkpoint resumes only into the same parallel layout (tp, dp, mode, ZeRO stage)
and data order (batch size, accumulation, seq len, seed); to change the layout, export the weights and
--init-from them.

`Checkpointer.save(step)` may be called at any step boundary; the loop calls it when `Checkpointer.due(step)` and at
a preemption, but never after a step whose update the non-finite guard skipped (`gpt2.engines.guard`; a due save waits
for
the next applied step). So every checkpoint holds only finite updates and ends outside a run of bad steps, and the
newest good checkpoint is the one just written, which --keep-last never deletes. Every function here that touches
the process group is collective.

Integrity: before anything in a checkpoint is loaded (resume, export), rank 0 checks every file against
`manifest.json`: a missing, truncated, modified or unlisted file is refused with a CheckpointError naming it, so
DeepSpeed's pickles (its loaders use torch.load(weights_only=False)) are never unpickled unless every file matches
what the save wrote. Our own files are also loaded with weights_only=True. The manifest guards against
truncation, corruption and files mixed in from elsewhere; it is not a signature (whoever can rewrite the folder
can rewrite the manifest). Checkpoints from before manifests: single/baseline ones (weights_only files only) load
with a warning; hybrid ones (pickles) are refused unless GPT2_TRUST_UNVERIFIED_CHECKPOINT=1 is set.

Fault injection (tests only): with `GPT2_TEST_KILL_AT=STAGE@STEP` in the environment, the saver SIGKILLs its own
process when the save of step STEP reaches STAGE (one of `SAVE_STAGES`; `@STEP` may be left out: every save).
With several ranks, each rank that reaches STAGE kills itself: every rank at rank-state-written and
model-state-written, rank 0 alone at the others (they run in rank 0's prepare and commit); the launcher stops the
rest. tests/integration/test_faults.py kills real single-process runs at every stage and resumes them;
tests/fault_chain.py
does it for 2 ranks (DDP at 6 stages; ZeRO-3 at the two around engine.save_state and at pruned), one launch per
kill.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gpt2.config.layout import RunLayout
from gpt2.config.schema import CheckpointConfig, ConfigError, RunConfig, TrainConfig
from gpt2.data.loader import BatchLoader
from gpt2.engines.base import Engine, lr_at
from gpt2.engines.guard import NonFiniteError
from gpt2.observe.run_logging import log
from gpt2.runtime.distributed import DistContext

GIB = 1024**3  # sizes in messages
LATEST = "latest"
PENDING = "latest.pending"
META = "meta.json"
MANIFEST = "manifest.json"
TRUST_ENV = "GPT2_TRUST_UNVERIFIED_CHECKPOINT"
FAULT_ENV = "GPT2_TEST_KILL_AT"
# the stages of a save, in order, at which GPT2_TEST_KILL_AT can stop it ("prune-*" only when --keep-last deletes)
SAVE_STAGES = ("tmp-created", "rank-state-written", "model-state-written", "meta-written", "manifest-written",
               "synced",
               "pending-written", "renamed", "latest-written", "prune-renamed", "prune-partial", "pruned")
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
# meta.json fields that must match for a resume (the parallel layout decides how state is sharded)
# batch_size, grad_accum, seq_len and seed too: the data position counts micro-batches of packed sequences in a
# seeded order, so other values would replay or skip data (the data loader re-checks them when it restores)
_LAYOUT_KEYS = ("mode", "world_size", "tp_size", "dp_size", "zero_stage", "batch_size", "grad_accum", "seq_len",
                "seed")


class CheckpointError(ConfigError):
    """A missing, partial, mismatched or colliding checkpoint; the message names what differs."""


EXIT_SAVE_FAILED = 74  # sysexits' EX_IOERR: a save could not be written (disk full, I/O error)


class SaveError(CheckpointError):
    """A save the file system refused (disk full, I/O error), raised on every rank; the message names the step and
    the newest good checkpoint. The partial `.tmp` folder is never read (the next save removes it)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _fault_point(stage: str, step: int) -> None:
    """Test-only: SIGKILL this process here when GPT2_TEST_KILL_AT names this stage (and step)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want, _, at = spec.partition("@")
    if want == stage and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def list_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """Complete-looking step folders (name step-XXXXXX, not .tmp), oldest first."""
    if not save_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in save_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


# ------------------------------------------------------------------------------------------------
# metadata and validation


def build_meta(layout: RunLayout, step: int) -> dict[str, Any]:
    cfg = layout.cfg
    meta = {
        "step": step, "mode": layout.mode, "model_name": cfg.train.model, "model": dataclasses.asdict(cfg.model),
        "world_size": layout.world_size, "tp_size": layout.tp_size, "dp_size": layout.dp_size,
        "zero_stage": layout.zero_stage,
        "batch_size": cfg.train.batch_size, "grad_accum": layout.grad_accum, "seq_len": cfg.train.seq_len,
        "seed": cfg.train.seed, "max_steps": cfg.train.max_steps,
        "torch_version": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if layout.fsdp2:  # absent from DeepSpeed's (and older) hybrid checkpoints: check_compatible reads that as deepspeed
        meta["zero_engine"] = layout.zero_engine
        meta["fsdp2_params"] = layout.cfg.parallel.fsdp2_params  # flat: another set of tensors (absent: tensors)
        meta["fsdp2_unit_blocks"] = layout.fsdp2_unit_blocks  # flat tensors are per unit
    elif layout.mode == "hybrid":
        meta["deepspeed_version"] = importlib.metadata.version("deepspeed")  # no import: it picks an accelerator
        meta["zero3_fetch"] = layout.zero3_fetch  # what ZeRO-3's hooks gathered (None: no hooks; absent: before it)
        meta["zero3_flat"] = layout.zero3_flat  # another set of parameter tensors (absent: false)
        meta["zero3_unit_blocks"] = layout.zero3_unit_blocks  # another set of parameter names (absent: 1)
    return meta


def read_meta(step_dir: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint folder; CheckpointError for a missing or partial one."""
    if step_dir.name.endswith(".tmp"):
        raise CheckpointError(f"{step_dir} is a partial checkpoint (a save that did not finish); resume from a "
                              f"complete step-XXXXXX folder or from the save dir (its `latest` pointer)")
    if step_dir.is_file():
        raise CheckpointError(f"{step_dir} is a file, not a checkpoint folder; pass the step folder that holds it "
                              f"({step_dir.parent}) or its save dir")
    if not step_dir.is_dir():
        raise CheckpointError(f"checkpoint {step_dir} does not exist")
    meta_path = step_dir / META
    if not meta_path.is_file():
        if found := list_checkpoints(step_dir):
            raise CheckpointError(f"{step_dir} is a save dir without a `{LATEST}` pointer; pass one of its step "
                                  f"folders (the newest: {found[-1][1]})")
        raise CheckpointError(f"{step_dir} has no {META}: it is a partial or foreign checkpoint, not resumable")
    try:  # read before the manifest check (it says which layout to verify): a damaged one is refused here
        meta = json.loads(meta_path.read_text())
        if not (isinstance(meta, dict) and isinstance(meta.get("model"), dict) and isinstance(meta.get("step"), int)
                and isinstance(meta.get("mode"), str)):
            raise ValueError("not a checkpoint's meta record")
    except ValueError as e:
        raise CheckpointError(f"{meta_path} is damaged ({e}): refusing {step_dir}; resume from another step folder "
                              "(its save dir holds the older ones unless --keep-last removed them)") from None
    return meta


def _zero3_unit_diffs(meta: dict[str, Any], layout: RunLayout) -> list[str]:
    """How a checkpoint's ZeRO-3 parameter sets (flat tensors, unit names) differ from this run's, with the flag
    that resumes it where this run takes one."""
    diffs = []
    # checkpoints from before these keys (and from before flat units became the default): block, 1 block a leaf
    flat, unit = meta.get("zero3_flat", False), meta.get("zero3_unit_blocks", 1)

    def resume_with(flag: str) -> str:  # runs without ZeRO-3's gather hooks refuse both flags: no such fix
        return f"; resume it with {flag}" if layout.zero3_fetch is not None else ""

    if flat != layout.zero3_flat:
        fetch = meta.get("zero3_fetch") or ("flat" if flat else "block")
        diffs.append(f"zero3_flat: checkpoint {flat!r}, this run {layout.zero3_flat!r} (--zero3-fetch flat keeps "
                     f"each block's parameters in flat tensors{resume_with(f'--zero3-fetch {fetch}')})")
    if unit != layout.zero3_unit_blocks:
        diffs.append(f"zero3_unit_blocks: checkpoint {unit}, this run {layout.zero3_unit_blocks} "
                     f"(--zero3-unit-blocks names the parameters by unit"
                     f"{resume_with(f'--zero3-unit-blocks {unit}')})")
    return diffs


def _fsdp2_diffs(meta: dict[str, Any], layout: RunLayout) -> list[str]:
    """How a checkpoint's FSDP2 parameter set differs from this run's, with the flag that resumes it: flat tensors
    (--fsdp2-params flat) are per unit, per-tensor checkpoints hold the blocks' own names at any unit size."""
    params, ours = meta.get("fsdp2_params", "tensors"), layout.cfg.parallel.fsdp2_params
    unit = meta.get("fsdp2_unit_blocks")
    if params != ours:
        units = f" --fsdp2-unit-blocks {unit}" if params == "flat" else ""
        return [f"fsdp2_params: checkpoint {params!r}, this run {ours!r} (--fsdp2-params flat keeps each unit's "
                f"parameters in flat tensors; resume it with --fsdp2-params {params}{units})"]
    if params == "flat" and unit != layout.fsdp2_unit_blocks:
        return [f"fsdp2_unit_blocks: checkpoint {unit}, this run {layout.fsdp2_unit_blocks} (a flat tensor holds one "
                f"unit's parameters; resume it with --fsdp2-unit-blocks {unit})"]
    return []


def check_compatible(meta: dict[str, Any], layout: RunLayout, where: Path) -> None:
    """Model config and parallel layout must match the checkpoint's (the error lists every difference), and
    the checkpoint must lie before --max-steps."""
    max_steps = layout.cfg.train.max_steps
    if meta["step"] >= max_steps:
        raise CheckpointError(f"{where} is at step {meta['step']}, not before --max-steps {max_steps}; "
                              f"pass --max-steps > {meta['step']} to train further")
    ours = build_meta(layout, step=meta["step"])
    diffs = [f"model.{k}: checkpoint {v!r}, this run {ours['model'].get(k)!r}"
             for k, v in meta["model"].items() if ours["model"].get(k) != v]
    diffs += [f"{k}: checkpoint {meta.get(k)!r}, this run {ours[k]!r}" for k in _LAYOUT_KEYS if meta.get(k) != ours[k]]
    if meta["mode"] == ours["mode"] == "hybrid":
        if meta.get("zero_engine", "deepspeed") != layout.zero_engine:  # the one difference: the engine's parameter
            # sets differ with it, and DeepSpeed's fetch flags (refused under FSDP2) cannot bridge it
            diffs.append(f"zero_engine: checkpoint {meta.get('zero_engine', 'deepspeed')!r}, this run "
                         f"{layout.zero_engine!r} (--zero-engine)")
        else:
            diffs += _fsdp2_diffs(meta, layout) if layout.fsdp2 else _zero3_unit_diffs(meta, layout)
    if diffs:
        raise CheckpointError(
            f"checkpoint {where} does not match this run: " + "; ".join(diffs)
            + ". Resume with the same model, mode and parallel layout, or export its weights "
            f"(python -m gpt2.train.export {where} OUT) and start a new run with --init-from OUT")


def resolve_resume(ckpt: CheckpointConfig) -> Path | None:
    """The step folder to resume from: --resume auto -> save_dir's latest (None if there is none yet);
    --resume PATH -> PATH if it is a step folder, else PATH's latest."""
    if not ckpt.resume:
        return None
    root = Path(ckpt.save_dir if ckpt.resume == "auto" else ckpt.resume)
    pointer = root / LATEST
    pending = _pending_checkpoint(root)
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if not (target / META).is_file():
            raise CheckpointError(f"{pointer} points at {target.name}, which is missing or incomplete")
        if pending is not None and _step_of(pending) > _step_of(target):
            log.warning("checkpoint: %s is complete but `%s` still names %s (a save was stopped between its "
                        "rename and the pointer update): resuming from the newer %s", pending.name, LATEST,
                        target.name, pending.name)
            return pending
        return target
    if pending is not None:
        log.warning("checkpoint: %s is complete but there is no `%s` pointer yet (the first save was stopped "
                    "before writing it): resuming from %s", pending.name, LATEST, pending.name)
        return pending
    if found := list_checkpoints(root):
        raise CheckpointError(f"{root} holds step folders but no `{LATEST}` pointer; pass --resume "
                              f"{found[-1][1]} to choose one explicitly")
    if ckpt.resume == "auto":
        return None
    read_meta(root)  # raises for missing / partial / foreign folders
    return root


def _step_of(step_dir: Path) -> int:
    m = _STEP_DIR.match(step_dir.name)
    return int(m.group(1)) if m else -1


def _finish_interrupted_commit(save_dir: Path) -> None:
    """Point `latest` at the complete folder that `latest.pending` names when it is newer (a save stopped between
    its rename and the pointer update; --resume auto resumed from it). A new save overwrites `latest.pending`
    before its own rename: a kill there would otherwise leave `latest` at the older step, and the next --resume
    auto would go back to it and refuse to overwrite the newer folder."""
    pending = _pending_checkpoint(save_dir)
    pointer = save_dir / LATEST
    if pending is not None and (not pointer.is_file()
                                or _step_of(save_dir / pointer.read_text().strip()) < _step_of(pending)):
        _write_text_atomic(pointer, pending.name + "\n")


def _pending_checkpoint(root: Path) -> Path | None:
    """The folder `latest.pending` names, if it is complete (renamed, with its meta.json); else None."""
    path = root / PENDING
    if not path.is_file():
        return None
    target = root / path.read_text().strip()
    if _STEP_DIR.match(target.name) and (target / META).is_file():
        return target
    return None  # the save stopped before its rename: `latest` is still right


# ------------------------------------------------------------------------------------------------
# integrity: manifest.json


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[str]:
    """Every file under `folder` but the manifest, as sorted relative POSIX paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST)


def write_manifest(folder: Path) -> None:
    """manifest.json: size and sha256 of every other file in `folder` (call it after the last file is written)."""
    entries = {rel: {"size": (folder / rel).stat().st_size, "sha256": _sha256(folder / rel)} for rel in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps({"version": 1, "files": entries}, indent=1))


_verified: set[Path] = set()  # folders checked in this process (resume checks at start-up, then loads)


def verify_checkpoint(folder: Path) -> None:
    """Refuse (CheckpointError naming the file) a checkpoint whose files do not match its manifest.json."""
    key = folder.resolve()
    if key in _verified:
        return
    path = folder / MANIFEST
    if not path.is_file():
        hybrid = read_meta(folder).get("mode") == "hybrid"
        if hybrid and os.environ.get(TRUST_ENV) != "1":
            raise CheckpointError(
                f"{folder} has no {MANIFEST} (saved before checkpoints had one), and its DeepSpeed files are "
                f"pickles that loading would execute: refusing to load it unverified. If you trust its origin, "
                f"set {TRUST_ENV}=1")
        log.warning("checkpoint: %s has no %s (saved before checkpoints had one): its files are not verified%s",
                    folder, MANIFEST, f" ({TRUST_ENV}=1)" if hybrid else "; they load with weights_only=True")
        _verified.add(key)
        return
    try:
        listed = json.loads(path.read_text())["files"]
        assert isinstance(listed, dict) and all(isinstance(want, dict) and isinstance(want.get("size"), int)
                                                and isinstance(want.get("sha256"), str) for want in listed.values())
    except (ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"{path} is not a valid checkpoint manifest: refusing to load {folder}") from None
    for rel, want in listed.items():
        file = folder / rel
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in {path} but missing: refusing to load {folder}")
        size = file.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{file} is {size} bytes, {MANIFEST} says {want['size']} (truncated or "
                                  f"replaced): refusing to load {folder}")
        if _sha256(file) != want["sha256"]:
            raise CheckpointError(f"{file} does not match its sha256 in {MANIFEST} (modified or replaced): "
                                  f"refusing to load {folder}")
    extra = [rel for rel in _files(folder) if rel not in listed]
    if extra:
        raise CheckpointError(f"{folder / extra[0]} is not in {MANIFEST}: a file the save did not write; refusing to "
                              f"load {folder}")
    _verified.add(key)


# ------------------------------------------------------------------------------------------------
# per-rank state: RNG and data position


def _rng_state(device: torch.device) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank:05d}.pt"


# ------------------------------------------------------------------------------------------------
# file-system helpers


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync_path(Path(dirpath) / f)
        _fsync_path(Path(dirpath))


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _remove_checkpoint(folder: Path, step: int) -> None:
    """Delete a step folder so that no kill leaves a half-deleted `step-XXXXXX`: rename it away first."""
    doomed = folder.with_name(folder.name + ".deleting")
    os.rename(folder, doomed)
    _fsync_path(folder.parent)
    _fault_point("prune-renamed", step)
    first = next((p for p in sorted(doomed.iterdir()) if p.is_file()), None)
    if first is not None:
        first.unlink()
    _fault_point("prune-partial", step)
    shutil.rmtree(doomed)


def _on_rank0(ctx: DistContext, fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0 and raise its CheckpointError (of the same class) on every rank (no rank is left
    waiting)."""
    error = None
    if ctx.is_main:
        try:
            fn()
        except CheckpointError as err:
            error = err
    if ctx.distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise error


def _save_error(err: OSError | RuntimeError, need: float, step: int, tmp: Path) -> SaveError:
    """What stopped a save's writes, in one line: a full disk (ENOSPC; torch.save reports it only as "file write
    failed", so then: less free space left than this layout's checkpoint size) or another write error."""
    save_dir = tmp.parent
    free = shutil.disk_usage(save_dir).free
    full = (err.errno in (errno.ENOSPC, errno.EDQUOT) if isinstance(err, OSError)
            else "file write failed" in str(err) and free < need)
    what = (f"no space left on device ({free / GIB:.2f} GiB free, a checkpoint needs about {need / GIB:.2f} GiB)"
            if full else f"a write failed ({str(err).splitlines()[0]})")
    return SaveError(f"{what} while saving step {step} in {tmp}; latest good checkpoint: "
                     f"{newest_checkpoint(save_dir)} (the partial {tmp.name} is never read; the next save removes it); "
                     "free space, then resume with --resume auto")


def _is_write_error(err: Exception) -> bool:
    """An OSError, or torch.save's writer failing (a RuntimeError naming PytorchStreamWriter)."""
    return isinstance(err, OSError) or (isinstance(err, RuntimeError) and "PytorchStreamWriter" in str(err))


# ------------------------------------------------------------------------------------------------
# save and load


def newest_checkpoint(save_dir: Path) -> str:
    """What `latest` names in `save_dir`, for messages about a save that did not happen."""
    pointer = save_dir / LATEST
    return f"{save_dir / pointer.read_text().strip()}" if pointer.is_file() else f"none in {save_dir}"


def check_weights_finite(ctx: DistContext, engine: Engine, step: int, save_dir: Path) -> None:
    """Refuse, on every rank, to checkpoint weights that hold a NaN or an infinity, whatever let them through (the
    guard judges a step by its loss and gradient norm, not by the update: a huge --lr applies a finite gradient as
    an infinite step). Each rank checks what it holds: its ZeRO-3 partition (`ds_tensor`), its FSDP2 shards, else its
    parameters."""
    held = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    held = [t.to_local() if isinstance(t, DTensor) else t for t in held]  # FSDP2: this rank's shard
    # each flag moved to this rank's device: a --ds-config may offload the partitions to the CPU
    flags = [t.isfinite().all().to(ctx.device) for t in held]
    finite = (torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=ctx.device)).float()
    finite = finite.reshape(1)
    if ctx.distributed:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise NonFiniteError(f"the weights after step {step} hold non-finite values although its loss and gradient "
                             f"norm were finite (an update too large: lower --lr or --grad-clip): not saved; newest "
                             f"checkpoint: {newest_checkpoint(save_dir)}")


def save_checkpoint(layout: RunLayout, ctx: DistContext, engine: Engine, train_loader: BatchLoader, step: int,
                    checkpoint_size: float, keep_last: int | None = None) -> Path:
    """Write <save_dir>/step-XXXXXX atomically and point `latest` at it (collective). `checkpoint_size`: the
    planner's estimate in bytes (`gpt2.planning.planner.Plan.checkpoint_bytes`, made by train.py), for a full disk's
    message."""
    save_dir = Path(layout.cfg.checkpoint.save_dir)
    check_weights_finite(ctx, engine, step, save_dir)
    final = save_dir / step_dir_name(step)
    tmp = final.with_name(final.name + ".tmp")

    def prepare() -> None:
        if final.exists():
            raise CheckpointError(f"checkpoint {final} already exists; nothing is overwritten: resume from it, "
                                  "or use another --save-dir")
        save_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by an interrupted save of this step
        for doomed in save_dir.glob("step-*.deleting"):
            shutil.rmtree(doomed)  # left by an interrupted --keep-last deletion
        _finish_interrupted_commit(save_dir)
        tmp.mkdir()
        _fault_point("tmp-created", step)

    _on_rank0(ctx, prepare)
    failure = None
    try:
        torch.save({"rng": _rng_state(ctx.device), "data": train_loader.state_dict(), "step": step},
                   _rank_file(tmp, ctx.rank))
        _fault_point("rank-state-written", step)
        engine.save_state(tmp, step)
    except (OSError, RuntimeError) as err:
        if not _is_write_error(err):
            raise
        failure = _save_error(err, checkpoint_size, step, tmp)
    _fault_point("model-state-written", step)
    if ctx.distributed:  # every rank stops on any rank's failed write (its peers would wait at the commit)
        failures: list[SaveError | None] = [None] * ctx.world_size
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise failure
    ctx.barrier()

    def commit() -> None:
        try:
            write_commit()
        except OSError as err:  # meta.json, the manifest, the pointers: small, but the disk may just have filled
            raise _save_error(err, checkpoint_size, step, tmp) from None

    def write_commit() -> None:
        (tmp / META).write_text(json.dumps(build_meta(layout, step), indent=2))
        _fault_point("meta-written", step)
        write_manifest(tmp)  # last: covers every file of every rank, meta.json included
        _fault_point("manifest-written", step)
        _fsync_tree(tmp)
        _fault_point("synced", step)
        _write_text_atomic(save_dir / PENDING, final.name + "\n")  # a kill after the rename still finds it
        _fault_point("pending-written", step)
        os.rename(tmp, final)
        _fsync_path(save_dir)
        _fault_point("renamed", step)
        _write_text_atomic(save_dir / LATEST, final.name + "\n")
        _fault_point("latest-written", step)
        (save_dir / PENDING).unlink()
        _fsync_path(save_dir)
        if keep_last:  # only checkpoints older than this one: never the one `latest` now points at
            older = [p for s, p in list_checkpoints(save_dir) if s < step]
            for old in older[:max(0, len(older) - (keep_last - 1))]:
                _remove_checkpoint(old, step)
        _fault_point("pruned", step)

    _on_rank0(ctx, commit)
    log.info("checkpoint: saved %s", final)
    return final


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from: its step folder and its meta.json, read and checked once."""

    folder: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def load_checkpoint(resume: ResumePoint, layout: RunLayout, ctx: DistContext, engine: Engine,
                    train_loader: BatchLoader) -> int:
    """Restore everything saved in the resume point's folder (collective); returns the step to continue after."""
    step_dir, step = resume.folder, resume.step
    _on_rank0(ctx, lambda: verify_checkpoint(step_dir))  # before any file is unpickled, ours or DeepSpeed's
    rank_path = _rank_file(step_dir, ctx.rank)
    if not rank_path.is_file():
        raise CheckpointError(f"{step_dir} has no {rank_path.name}: the checkpoint is incomplete")
    rank_state = torch.load(rank_path, map_location="cpu", weights_only=True)
    recorded = engine.load_state(step_dir)
    if recorded is not None and recorded != step:
        raise CheckpointError(f"{step_dir}: the engine's state is from step {recorded}, meta.json says {step}")
    train_loader.load_state_dict(rank_state["data"])
    _set_rng_state(rank_state["rng"], ctx.device)
    log.info("checkpoint: resumed from %s (step %d)", step_dir, step)
    return step


def _save_due(cfg: RunConfig, step: int) -> bool:
    interval = cfg.checkpoint.save_interval
    return step == cfg.train.max_steps or bool(interval and step % interval == 0)


def check_save_dir(cfg: RunConfig, resume_from: Path | None, start_step: int) -> None:
    """Fail before training, not after it, when --save-dir holds another run's checkpoints (this run would move
    `latest` and --keep-last would delete them) or a step folder this run would write."""
    if not cfg.checkpoint.save_dir:
        return
    save_dir = Path(cfg.checkpoint.save_dir)
    existing = list_checkpoints(save_dir)
    continues_here = resume_from is not None and resume_from.parent.resolve() == save_dir.resolve()
    if existing and not continues_here:
        raise CheckpointError(f"--save-dir {save_dir} already holds checkpoints of another run "
                              f"({existing[0][1].name} ... {existing[-1][1].name}); nothing is overwritten: continue "
                              "that run with --resume auto, or pass a new --save-dir")
    ahead = [p.name for s, p in existing if start_step < s <= cfg.train.max_steps and _save_due(cfg, s)]
    if ahead:
        raise CheckpointError(f"--save-dir {cfg.checkpoint.save_dir} already holds {', '.join(ahead)}, which this "
                              "run would write; nothing is overwritten: use another --save-dir or resume from its "
                              "latest checkpoint (--resume auto)")


def _saves_ahead(cfg: RunConfig, start_step: int) -> int:
    """How many checkpoints a run from `start_step` writes: every --save-interval steps and the last step."""
    interval, last = cfg.checkpoint.save_interval, cfg.train.max_steps
    every = last // interval - start_step // interval if interval else 0
    return every + (0 if interval and last % interval == 0 else 1)


def check_save_space(layout: RunLayout, start_step: int, checkpoint_size: float) -> None:
    """Free space on --save-dir's file system against the planner's checkpoint size (`checkpoint_size` bytes, from
    train.py: this module never imports the planner), at start-up: less than one
    checkpoint is an error (the first save would fail after training); less than the run keeps at once (all of its
    saves, or --keep-last K + the one being written) a warning."""
    cfg = layout.cfg
    if not cfg.checkpoint.save_dir:
        return
    save_dir = Path(cfg.checkpoint.save_dir)
    free = shutil.disk_usage(next(p for p in (save_dir, *save_dir.parents) if p.exists())).free
    need = checkpoint_size
    if free < need:
        raise CheckpointError(f"--save-dir {save_dir}: {free / GIB:.2f} GiB free, but one checkpoint of this run "
                              f"needs about {need / GIB:.2f} GiB (the planner's estimate); free space or pass a "
                              "--save-dir on another file system")
    saves = _saves_ahead(cfg, start_step)
    held = min(saves, cfg.checkpoint.keep_last + 1) if cfg.checkpoint.keep_last else saves
    if free < held * need:
        log.warning("--save-dir %s: %.2f GiB free, but the %d checkpoints this run keeps need about %.2f GiB "
                    "(%.2f GiB each); a save that does not fit stops the run (exit %d); bound them with --keep-last",
                    save_dir, free / GIB, held, held * need / GIB, need / GIB, EXIT_SAVE_FAILED)


def schedule_change(meta: dict[str, Any], train: TrainConfig) -> str | None:
    """What resuming a checkpoint made by a run of another --max-steps does to the LR schedule (recomputed for this
    run's length: gpt2.engines.base.lr_at), or None where it stays the same (same length, or a constant LR after
    the warm-up). Stated, not refused: extending a finished run, or resuming a preempted one to a new end, is
    what such a resume is for."""
    saved = meta.get("max_steps")
    if saved in (None, train.max_steps) or train.min_lr == train.lr:
        return None
    step = meta["step"]
    was, now = lr_at(step, dataclasses.replace(train, max_steps=saved)), lr_at(step, train)
    return (f"resume: the checkpoint at step {step} was made by a run of --max-steps {saved}; this run's --max-steps "
            f"{train.max_steps} recomputes the LR schedule (step {step + 1}'s LR: {was:.4g} in the checkpoint's "
            f"schedule, {now:.4g} now); pass --max-steps {saved} to keep the checkpoint's schedule")


def prepare_resume(layout: RunLayout, ctx: DistContext, checkpoint_size: float) -> ResumePoint | None:
    """Start-up checks, cheap and before anything heavy: resolve --resume, check it matches this run, check
    --save-dir holds nothing this run would write and has room for `checkpoint_size` bytes a save. The run folder's
    config.json records `folder.resolve()`."""
    cfg = layout.cfg
    resume_from = resolve_resume(cfg.checkpoint)
    resume = None
    if resume_from:
        resume = ResumePoint(resume_from, read_meta(resume_from))
        _on_rank0(ctx, lambda: verify_checkpoint(resume_from))  # at start-up: a bad file fails before any work
        check_compatible(resume.meta, layout, resume_from)
        if ctx.is_main and (change := schedule_change(resume.meta, cfg.train)):
            log.warning("%s", change)
    check_save_dir(cfg, resume_from, resume.step if resume else 0)
    check_save_space(layout, resume.step if resume else 0, checkpoint_size)
    return resume


class Checkpointer:
    """Saves at --save-interval steps and at the end of training (when `due`); `save(step)` works at any step
    boundary."""

    def __init__(self, layout: RunLayout, ctx: DistContext, engine: Engine, train_loader: BatchLoader,
                 checkpoint_size: float):
        self.layout, self.cfg, self.ctx, self.engine, self.train_loader = layout, layout.cfg, ctx, engine, train_loader
        self.checkpoint_size = checkpoint_size  # bytes, the planner's estimate (train.py): for a full disk's message

    def due(self, step: int) -> bool:
        """A save is due after `step`: every --save-interval steps and at --max-steps."""
        return _save_due(self.cfg, step)

    def save(self, step: int) -> Path:
        return save_checkpoint(self.layout, self.ctx, self.engine, self.train_loader, step, self.checkpoint_size,
                               self.cfg.checkpoint.keep_last)
