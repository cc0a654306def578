"""Run folder, console log, JSONL metrics and Weights & Biases: what a run leaves behind.

Only rank 0 writes. A run folder is never reused: an existing name gets a numeric suffix.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import math
import netrc
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gpt2.config.schema import ConfigError, RunConfig, compile_label

log = logging.getLogger("gpt2")


class WriteFailed(Exception):
    """A file of the run (its run folder, a token cache) that the file system refused (disk full); nothing
    half-written is left. train.py exits 74 (EXIT_SAVE_FAILED), like a refused checkpoint save."""


def write_failed(path: Path, err: OSError) -> WriteFailed:
    """The one line for a refused write of `path`: a full disk, or the error itself."""
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    what = "no space left on device" if full else f"a write failed ({err.strerror or err})"
    return WriteFailed(f"{what} while writing {path}; free space, then rerun (with --save-dir, --resume auto "
                       "continues from the newest checkpoint)")


def make_run_dir(cfg: RunConfig) -> Path:
    """Create a fresh run folder under --out-dir; never returns an existing folder."""
    name = cfg.log.run_name or f"{cfg.train.mode}-{cfg.train.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    root = Path(cfg.log.out_dir)
    candidate, n = root / name, 1
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                candidate, n = root / f"{name}-{n}", n + 1
    except OSError as err:
        raise write_failed(candidate, err) from None


class _RunFileHandler(logging.FileHandler):
    """console.log: a refused write (disk full) says so once on the terminal and stops writing the file, instead
    of logging's traceback at every record; metrics.jsonl's next write then stops the run (WriteFailed)."""

    def handleError(self, record: logging.LogRecord) -> None:
        log.removeHandler(self)
        logging.getLogger("py.warnings").removeHandler(self)
        self.close()
        log.warning("%s: a write failed; logging to the terminal only", self.baseFilename)


def setup_console(run_dir: Path | None, is_main: bool) -> None:
    """Log to the console and (rank 0) to run_dir/console.log; other ranks only log warnings."""
    for handler in log.handlers:  # an earlier run's console.log (train.main called again in one process)
        handler.close()
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    stream = logging.StreamHandler()
    stream.setFormatter(fmt)
    log.addHandler(stream)
    if run_dir is not None:
        try:
            file = _RunFileHandler(run_dir / "console.log")
        except OSError as err:
            raise write_failed(run_dir / "console.log", err) from None
        file.setFormatter(fmt)
        log.addHandler(file)
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").handlers = log.handlers


def _write_whole(path: Path, text: str) -> None:
    """`path` with `text`, or (disk full) unchanged: written beside it and renamed; WriteFailed when refused."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise write_failed(path, err) from None


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe: NaN/inf become null (standard JSON has neither)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def run_label(mode: str, zero_stage: int, tp: int, sequence_parallel: bool, zero_engine: str = "deepspeed") -> str:
    """The configuration's name in reports and wandb job types: single, ddp, zero3, zero3-tp2-sp, fsdp2 (ZeRO-3 by
    FSDP2), fsdp2-zero2, fsdp2-tp2, ...

    Modes other than ours (e.g. `hf-ddp`, `hf-zero3` from tools/hf_reference.py) keep their own name."""
    hybrid = f"zero{zero_stage}"
    if zero_engine == "fsdp2":
        hybrid = "fsdp2" if zero_stage == 3 else f"fsdp2-{hybrid}"
    name = {"single": "single", "baseline": "ddp", "hybrid": hybrid}.get(mode, mode)
    return name + (f"-tp{tp}" if tp > 1 else "") + ("-sp" if sequence_parallel else "")


def wandb_identity(cfg: RunConfig) -> dict[str, Any]:
    """group / job_type / tags, so a wandb workspace groups and filters runs the way tools.report does.

    group: --wandb-group, else model and sequence length (runs that are comparable); job_type: the
    configuration label; tags: --wandb-tags plus label, model, batch/GPU, precision, compile and kernels.
    """
    t, p = cfg.train, cfg.parallel
    label = run_label(t.mode, p.zero_stage, p.tp_size, p.sequence_parallel, p.zero_engine)
    compiled = compile_label(t.compile, t.compile_scope, t.compiler)
    auto = [label, t.model, f"bs{t.batch_size}", t.precision, f"compile-{compiled}" if t.compile else "eager",
            f"kernels-{t.fused_kernels}"] + (["ckpt"] if t.activation_checkpointing else [])
    return {"group": cfg.log.wandb_group or f"{t.model}-seq{t.seq_len}", "job_type": label,
            "tags": list(dict.fromkeys([*cfg.log.wandb_tags, *auto]))}


def wandb_host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"


def wandb_credentials() -> tuple[str | None, str]:
    """Where wandb would find an API key, without the network: (source, "") or (None, why there is none).

    Checked: WANDB_API_KEY is set and not blank, or the netrc file (`wandb login` writes it; $NETRC or ~/.netrc)
    parses and has a `machine <host>` entry (or a `default` one) with a non-empty password, host taken from
    WANDB_BASE_URL. Not checked: that the server accepts the key (no network call at start-up)."""
    if os.environ.get("WANDB_API_KEY", "").strip():
        return "WANDB_API_KEY", ""
    host = wandb_host()
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if not path.is_file():
        return None, f"WANDB_API_KEY is unset and {path} does not exist"
    try:
        parsed = netrc.netrc(str(path))
    except (netrc.NetrcParseError, OSError) as err:
        return None, f"WANDB_API_KEY is unset and {path} cannot be read as a netrc file ({err})"
    entry, name = parsed.hosts.get(host), f"machine {host}"
    if entry is None and "default" in parsed.hosts:
        entry, name = parsed.hosts["default"], "default"
    if entry is None:
        return None, f"WANDB_API_KEY is unset and {path} has no `machine {host}` entry"
    if not (entry[2] or "").strip():
        return None, f"WANDB_API_KEY is unset and the `{name}` entry of {path} has no password (the API key)"
    return f"{path} (`{name}`)", ""


def wandb_credentials_present() -> bool:
    return wandb_credentials()[0] is not None


def wandb_mode(requested: str | None) -> str:
    """online iff credentials are present, else offline; an explicit choice wins, but online needs credentials.
    Without --wandb, wandb's own WANDB_MODE=disabled, or a machine without the wandb package, means disabled (the
    metrics still go to metrics.jsonl); an explicit online/offline without the package is a start-up error."""
    if importlib.util.find_spec("wandb") is None:
        if requested in ("online", "offline"):
            raise ConfigError(f"--wandb {requested} needs the wandb package: pip install wandb, or run with "
                              "--wandb disabled (metrics.jsonl holds the same metrics)")
        return "disabled"
    if requested is None and os.environ.get("WANDB_MODE") == "disabled":
        return "disabled"
    source, why_not = wandb_credentials()
    if requested == "online" and source is None:
        raise ConfigError(f"--wandb online needs credentials ({why_not}): run `wandb login` or set WANDB_API_KEY; "
                          "or log locally with --wandb offline (upload later with `wandb sync`)")
    if requested:
        return requested
    return "online" if source else "offline"


class MetricsLogger:
    """JSONL (one record per log step + one summary record) and wandb, with the same metric names."""

    def __init__(self, cfg: RunConfig, run_dir: Path, record: dict[str, Any] | None = None):
        """`record`: what config.json and wandb's config hold (default: the parsed config; train.py passes the
        run layout's `config_record`, with the resolved values)."""
        self.run_dir = run_dir
        try:  # unbuffered: each record is one write, undone whole when refused (_append)
            self._jsonl = open(run_dir / "metrics.jsonl", "ab", buffering=0)  # noqa: SIM115 (closed in close())
        except OSError as err:
            raise write_failed(run_dir / "metrics.jsonl", err) from None
        record = record if record is not None else cfg.to_dict()
        _write_whole(run_dir / "config.json", json.dumps(record, indent=2))
        self._wandb = None
        mode = wandb_mode(cfg.log.wandb)
        if mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=cfg.log.wandb_project, name=run_dir.name, config=record, dir=str(run_dir), mode=mode,
                **wandb_identity(cfg),
            )
            log.info("wandb: %s mode, run %s", mode, run_dir.name)
            if mode == "online":
                log.info("wandb: API key from %s (the start-up check saw only that it is there; wandb.init has now "
                         "used it with %s)", wandb_credentials()[0], wandb_host())
            if mode == "offline":
                log.info("wandb: upload later with `wandb sync %s/wandb/offline-run-*`", run_dir)

    def _append(self, record: dict[str, Any]) -> None:
        """One JSONL record, all or nothing: a refused or short write is cut off again (a reader never sees half a
        record) and raises WriteFailed."""
        data = (json.dumps(record) + "\n").encode()
        size = os.fstat(self._jsonl.fileno()).st_size
        try:
            if self._jsonl.write(data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._jsonl.fileno(), size)
            raise write_failed(self.run_dir / "metrics.jsonl", err) from None

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        record = _clean({"type": "step", "step": step, **metrics})
        self._append(record)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        record = _clean({"type": "summary", **summary})
        self._append(record)
        _write_whole(self.run_dir / "summary.json", json.dumps(record, indent=2))
        if self._wandb is not None:
            for k, v in summary.items():
                if v is not None:
                    self._wandb.summary[k] = v

    def close(self) -> None:
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
