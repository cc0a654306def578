"""Data pipeline: text -> GPT-2 tokens -> on-disk token cache -> packed blocks -> DP-sharded batches.

Interface (what the engine calls)::

    bundle = build_data(cfg.data, seq_len=T, batch_size=B, model_vocab_size=cfg.model.vocab_size,
                        dp_rank=dims.dp_rank, dp_size=dims.dp_size, seed=cfg.train.seed,
                        is_main=<one process per cache filesystem>, barrier=<all ranks>)
    x, y = bundle.train.next_batch()          # int64 [B, T] each, CPU; rolls over epochs
    for x, y in bundle.val.iter_epoch(cfg.data.eval_batches): ...   # fixed order, sharded (None: --eval-batches 0)
    ckpt["data"] = bundle.train.state_dict(); bundle.train.load_state_dict(ckpt["data"])

`build_data` calls `barrier()` exactly once on every rank, after the main process has written any
missing token cache. Pass the global rank 0 as `is_main` when `cache_dir` is on a shared filesystem
(local rank 0 of each node otherwise). Tokenising WikiText-103 takes minutes on the main process, so
the barrier's process group needs a timeout longer than that (or pre-build the cache with
`python -m gpt2.data <train.py flags>`).

Sources (`--data`, `--data-path`):
  * `wikitext` (default): WikiText-103 raw from the hub, `load_dataset("wikitext", "wikitext-103-raw-v1")`,
    splits train / validation.
  * `--data-path FILE`: that file is the training text; its last 5% of tokens are the validation split.
  * `--data-path FOLDER`: text files (.txt, .raw, .tokens) named by role: `train*` -> train,
    `valid*` / `val*` / `dev*` -> validation, `test*` -> validation when there is no valid file.
    Without a train file, role-less files (corpus.txt) are the training text, else the valid files, and the
    next role validates (so `wikitext-2/` with valid.txt + test.txt trains on valid.txt and validates on
    test.txt; corpus.txt + test.txt trains on corpus.txt). Role-less files alone are the training text with a 5%
    tail for validation. Every other file of the folder is named in a warning as not used.
  * `synthetic`: uniform random tokens in [0, model_vocab_size), deterministic per seed (throughput runs).
Local files go through the `datasets` "text" builder so that they follow the hub data's path.

Documents: WikiText has one row per line; an article starts at a top-level heading row ` = Title = `
(not ` = = Section = = `). Rows are tokenised independently (batched, `num_proc` processes, like HF's
run_clm) and `<|endoftext|>` is inserted before every top-level heading, so every article starts with
EOT. Text without such headings is one continuous document per split.

Cache: each split's flat token stream is stored under `cache_dir` as a raw uint16 array (uint32 when
the vocab exceeds 65536 tokens) plus a JSON sidecar, keyed by sha256 of (source identity: hub
name+config+split, or the sha256 of each local file's bytes in order; tokenizer fingerprint, a hash of
its serialised content; EOT id; dtype; format version). Content, not paths or mtimes: a --cache-dir
built on one machine is a hit on another that holds the same text and tokenizer anywhere (every rank
hashes the text at start, ~1.7 GB/s: WikiText-103's 540 MB in ~0.3 s). A hit reads only the array and
its sidecar, never imports `datasets`, so a machine without `datasets` trains on real text from a
carried cache (a miss there is a DataError saying so). Written to a temporary file and renamed, sidecar
last; never depends on seq_len. The sidecar's n_tokens x dtype size and the array's sha256 (written at build)
are checked against the array file on open (a partial or damaged copy of --cache-dir between machines;
~0.15 s for WikiText-103's 240 MB): the main process rebuilds a mismatched cache with a warning, other ranks
name the file to delete. The format version is part of the key, so a cache of
another format (version 1 keyed files by path + mtime, 2 had no checksum) is never read; the main process names such
sidecars in a warning when it rebuilds.

Blocks and batches: block i is tokens[i*T : i*T + T + 1], x = block[:-1], y = block[1:] (consecutive
blocks share one boundary token, so every token is a target once). `--max-samples` keeps the first N
blocks. Each epoch of the training loader permutes the blocks with a generator seeded by (seed, epoch);
global batch b is perm[b*B*dp : (b+1)*B*dp] and DP rank r takes its r-th slice of B blocks. So ranks are
disjoint, every rank yields the same number of batches (the ragged tail is dropped), TP ranks with the
same DP rank get identical batches, and the global batch sequence depends on B*dp only: single-device
B=8 sees the same global batches as two DP ranks with B=4. Validation uses the same layout without
shuffling.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2.config.schema import DataConfig
from gpt2.data.tokenizer import (
    DataError,
    eot_token_id,
    hub_cache_only,
    hub_reachable,
    load_tokenizer,
    offline_message,
    tokenizer_fingerprint,
)
from gpt2.observe.run_logging import write_failed

__all__ = ["BatchLoader", "DataBundle", "DataError", "build_data", "resolve_splits"]

CACHE_FORMAT_VERSION = 3  # 3: the sidecar holds the array's sha256 (2: local files keyed by content; 1: by path)
HUB_DATASET = ("wikitext", "wikitext-103-raw-v1")
TEXT_SUFFIXES = (".txt", ".raw", ".tokens")
VAL_TAIL_FRACTION = 0.05  # validation share of a split-less corpus (a single file)
SYNTHETIC_TRAIN_BLOCKS = 4096
_TITLE = re.compile(r"^= [^=](.*[^=])? =$")  # " = Title = " after strip(); " = = Section = = " excluded
_ROLE_WORDS = {"train": ("train",), "valid": ("valid", "validation", "val", "dev"), "test": ("test",)}
_log = logging.getLogger("gpt2")


# ----------------------------------------------------------------------------------------------
# sources


@dataclass(frozen=True)
class TextSplit:
    """One split of text: a hub dataset split or local files, with the identity that keys its cache."""

    name: str  # "train" | "validation"
    label: str  # for logs
    files: tuple[Path, ...] = ()
    hub: tuple[str, str, str] | None = None  # (dataset, config, split)

    def identity(self) -> dict:
        if self.hub is not None:
            return {"hub": list(self.hub)}
        return {"files": [_text_sha256(f) for f in self.files]}  # content only: the cache travels


def _blocks(path: Path, chunk: int = 1 << 20) -> Iterator[bytes]:
    """A file's bytes in chunks (corpora and token caches can be hundreds of MB)."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            yield block


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    for block in _blocks(path):
        digest.update(block)
    return digest.hexdigest()


def _text_sha256(path: Path) -> str:
    """sha256 of a text file's bytes, checked to be UTF-8 text in the same pass: the tokeniser (datasets' text
    builder) would fail on anything else with a long traceback."""
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    for block in _blocks(path):
        digest.update(block)
        try:
            decoder.decode(block)
        except UnicodeDecodeError as e:
            raise DataError(f"--data-path: {path} is not UTF-8 text (byte {offset + e.start:,}: {e.reason}); "
                            "convert it (e.g. iconv -t utf-8) or leave it out") from None
        if (nul := block.find(b"\0")) >= 0:
            raise DataError(f"--data-path: {path} is binary, not text (a NUL byte at {offset + nul:,}); pass text "
                            "files only") from None
        offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"--data-path: {path} is not UTF-8 text (it ends inside a character); convert it (e.g. "
                        "iconv -t utf-8) or leave it out") from None
    return digest.hexdigest()


def _role(path: Path) -> str | None:
    """train / valid / test from the file name's words (valid.txt, wiki.train.raw, test_00.txt), else None."""
    words = set(re.split(r"[^a-z]+", path.name.lower()))
    return next((role for role, names in _ROLE_WORDS.items() if words & set(names)), None)


def resolve_splits(cfg: DataConfig) -> tuple[TextSplit, TextSplit | None]:
    """(train, validation) text; validation None means "the tail of train" (see module docstring)."""
    if not cfg.data_path:
        name, config = HUB_DATASET
        return (TextSplit("train", f"{name}/{config}:train (hub)", hub=(name, config, "train")),
                TextSplit("validation", f"{name}/{config}:validation (hub)", hub=(name, config, "validation")))
    root = Path(cfg.data_path).expanduser().resolve()
    if not root.exists():
        raise DataError(f"--data-path {cfg.data_path}: no such file or folder")
    if not (root.is_file() or root.is_dir()):
        raise DataError(f"--data-path {cfg.data_path}: not a regular file or a folder (a device or a pipe); pass "
                        "text files or a folder of them")
    if root.is_file():
        files, others = [root], []
    else:
        entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
        files = [p for p in entries if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES]
        others = [p for p in entries if p not in files]
        if not files:
            raise DataError(f"--data-path {cfg.data_path}: the folder holds no text files ({', '.join(TEXT_SUFFIXES)})")
    if not any(f.stat().st_size for f in files):
        raise DataError(f"--data-path {cfg.data_path}: the text files are empty")
    by_role: dict[str | None, list[Path]] = {}
    for f in files:
        by_role.setdefault(_role(f), []).append(f)
    # the training text: train* files, else the role-less ones, else valid*, else test*; validation: the next role
    train_files = next(by_role[role] for role in ("train", None, "valid", "test") if by_role.get(role))
    val_files = next((fs for fs in (by_role.get("valid"), by_role.get("test")) if fs and fs is not train_files), None)
    why = {None: "no train/valid/test in its name, and train* files are the training text",  # the roles left out
           "test": "test text is held out when valid* files validate"}
    ignored = [f"{f.name} ({why[_role(f)]})" for f in files if f not in train_files and f not in (val_files or [])]
    ignored += [f"{f.name} ({'a folder: not searched' if f.is_dir() else 'not ' + '/'.join(TEXT_SUFFIXES)})"
                for f in others]
    if ignored:
        _log.warning("--data-path %s: not used: %s", cfg.data_path, "; ".join(ignored))

    def split(name: str, fs: list[Path]) -> TextSplit:
        return TextSplit(name, ", ".join(str(f) for f in fs), files=tuple(fs))

    return split("train", train_files), (split("validation", val_files) if val_files else None)


# ----------------------------------------------------------------------------------------------
# tokenisation and the token cache


def _tokenize_rows(batch: dict[str, list[str]], tokenizer, eot: int) -> dict[str, list]:
    """Batched `datasets.map` function: token ids per row, EOT before each top-level heading."""
    texts = batch["text"]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out = [[eot, *row] if _TITLE.match(text.strip()) else row for text, row in zip(texts, ids)]
    return {"ids": out, "has_text": [bool(t.strip()) for t in texts]}


def _load_rows(split: TextSplit, hf_cache: Path):
    """A `datasets.Dataset` with a "text" column, one row per line."""
    import datasets

    if split.hub is None:
        return datasets.load_dataset("text", data_files=[str(f) for f in split.files], split="train",
                                     keep_linebreaks=True, cache_dir=str(hf_cache))
    name, config, hub_split = split.hub
    what = f"dataset {name}/{config} (--data {name})"
    if hub_reachable():
        return datasets.load_dataset(name, config, split=hub_split)
    try:
        with hub_cache_only():
            return datasets.load_dataset(name, config, split=hub_split)
    except (ConnectionError, FileNotFoundError, ValueError) as e:
        raise DataError(offline_message(what)) from e


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _build_cache(split: TextSplit, bin_path: Path, meta: dict, tokenizer, eot: int, num_proc: int) -> None:
    """Tokenise one split and write its flat stream (raw array) then its JSON sidecar."""
    try:
        import datasets  # noqa: F401 (imported where used; here only its absence is named)
    except ImportError as e:  # e.g. a GPU machine meant to run from a --cache-dir built elsewhere
        raise DataError(f"no token cache {bin_path} for the {split.name} text ({split.label}), and building one "
                        "needs the `datasets` package: install it, or copy a --cache-dir built elsewhere for the same "
                        "text and tokenizer (`python -m gpt2.data <train.py data flags>`)") from e
    # the intermediate files (the text as Arrow, the tokenised rows) live in a scratch folder removed with the build,
    # so a build stopped by a full disk leaves nothing that keeps the disk full
    with tempfile.TemporaryDirectory(prefix=".build-", dir=bin_path.parent, ignore_cleanup_errors=True) as scratch:
        try:
            _tokenise_into(split, bin_path, meta, tokenizer, eot, num_proc, Path(scratch))
        except OSError as err:
            raise write_failed(bin_path, err) from None


def _tokenise_into(split: TextSplit, bin_path: Path, meta: dict, tokenizer, eot: int, num_proc: int,
                   scratch: Path) -> None:
    import datasets
    import pyarrow.compute as pc

    rows = _load_rows(split, scratch / "hf-datasets")
    num_proc = max(1, min(num_proc, len(rows) // 1000 or 1))  # worker start-up dominates tiny inputs
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32")),
                                  "has_text": datasets.Value("bool")})
    tokens = rows.map(_tokenize_rows, batched=True, num_proc=num_proc if num_proc > 1 else None,
                      remove_columns=rows.column_names, features=features, cache_file_name=str(scratch / "ids.arrow"),
                      fn_kwargs={"tokenizer": tokenizer, "eot": eot}, desc=f"tokenising {split.name}")
    table = tokens.with_format("arrow")
    n_tokens = sum(int(pc.sum(pc.list_value_length(b["ids"])).as_py() or 0) for b in table.iter(batch_size=65536))
    n_text_rows = sum(int(pc.sum(b["has_text"]).as_py() or 0) for b in table.iter(batch_size=65536))
    dtype = np.dtype(meta["dtype"])

    def write_tokens(tmp: Path) -> None:
        if n_tokens == 0:
            tmp.write_bytes(b"")
            return
        out = np.memmap(tmp, dtype=dtype, mode="w+", shape=(n_tokens,))
        pos = 0
        for b in table.iter(batch_size=65536):
            flat = pc.list_flatten(b["ids"]).to_numpy()
            out[pos:pos + len(flat)] = flat
            pos += len(flat)
        out.flush()
        del out

    _write_atomic(bin_path, write_tokens)
    meta = {**meta, "n_tokens": n_tokens, "n_text_rows": n_text_rows, "n_rows": len(rows),
            "sha256": _sha256_file(bin_path)}
    _write_atomic(bin_path.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))


def _cache_paths(split: TextSplit, key_material: dict, cache_dir: Path) -> tuple[Path, dict]:
    material = {"version": CACHE_FORMAT_VERSION, "source": split.identity(), **key_material}
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return cache_dir / f"{split.name}-{key[:20]}.bin", material


def _other_format_sidecars(cache_dir: Path, split_name: str) -> list[Path]:
    """Sidecars of `split_name` caches written by another CACHE_FORMAT_VERSION (never matched: see the docstring)."""
    found = []
    for meta_path in sorted(cache_dir.glob(f"{split_name}-*.json")):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if json.loads(meta_path.read_text()).get("version") != CACHE_FORMAT_VERSION:
                found.append(meta_path)
    return found


def _cache_problem(bin_path: Path) -> str | None:
    """Why an existing sidecar's cache cannot be used (unreadable sidecar, missing, wrong-size or altered array:
    its sha256 against the sidecar's), or None. Token ids out of the vocabulary would fail mid-training otherwise
    (an IndexError on CPU, a device-side assert on a GPU), and caches are copied between machines."""
    meta_path = bin_path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
        expected = int(meta["n_tokens"]) * np.dtype(meta["dtype"]).itemsize
        checksum = str(meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its sidecar {meta_path} is unreadable ({e})"
    if not bin_path.exists():
        return f"{bin_path} is missing"
    size = bin_path.stat().st_size
    if size != expected:
        return (f"{bin_path} is {size:,} bytes but its sidecar says {meta['n_tokens']:,} {meta['dtype']} tokens "
                f"= {expected:,} bytes (a partial copy?)")
    if _sha256_file(bin_path) != checksum:
        return f"{bin_path} does not match the sha256 in its sidecar (altered or damaged after it was built)"
    return None


def _open_cache(bin_path: Path, split: TextSplit, data_path: str | None, verified: bool) -> np.ndarray:
    """The token stream of a cache; `verified`: this process checked (or built) it just before."""
    meta_path = bin_path.with_suffix(".json")
    if not meta_path.exists():
        raise DataError(f"token cache {bin_path} is missing after the main process built it; put --cache-dir on a "
                        "filesystem every rank can see, or make one process per node the main process")
    problem = None if verified else _cache_problem(bin_path)
    if problem is not None:  # the main process rebuilt any bad cache before the barrier: this rank sees another copy
        raise DataError(f"token cache {bin_path} is damaged: {problem}; delete {bin_path} and {meta_path} "
                        "and run again to rebuild it")
    meta = json.loads(meta_path.read_text())
    where = f"--data-path {data_path}" if data_path else split.label
    if meta["n_text_rows"] == 0 or meta["n_tokens"] == 0:
        raise DataError(f"{where}: the {split.name} text ({split.label}) holds no text")
    return np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))


# ----------------------------------------------------------------------------------------------
# batches


class BatchLoader:
    """DP-sharded batches of packed blocks from a flat token stream (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool, max_blocks: int | None = None, name: str = "train") -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.tokens = tokens
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.name = seed, shuffle, name
        n_blocks = max(len(tokens) - 1, 0) // seq_len
        self.num_blocks = min(n_blocks, max_blocks) if max_blocks is not None else n_blocks
        self.epoch = 0
        self.position = 0  # batches of `epoch` already returned by next_batch()
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_size

    def __len__(self) -> int:
        """Batches per epoch on each rank."""
        return self.num_blocks // self.global_batch

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_blocks)
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._order_cache = (epoch, rng.permutation(self.num_blocks))
        return self._order_cache[1]

    def block_indices(self, epoch: int, index: int) -> np.ndarray:
        """The B block numbers of batch `index` of `epoch` on this rank."""
        start = index * self.global_batch + self.dp_rank * self.batch_size
        return self._order(epoch)[start:start + self.batch_size]

    def batch(self, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` of `epoch` on this rank: x, y int64 [B, T]."""
        blocks = self.block_indices(epoch, index)
        T = self.seq_len
        rows = np.stack([self.tokens[b * T:b * T + T + 1] for b in blocks]).astype(np.int64)  # [B, T+1]
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()  # [B, T], [B, T]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        x, y = self.batch(self.epoch, self.position)
        self.position += 1
        return x, y

    def iter_epoch(self, max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of the current epoch from the start (at most `max_batches`); leaves the position alone."""
        n = len(self) if max_batches is None else min(len(self), max_batches)
        for i in range(n):
            yield self.batch(self.epoch, i)

    def state_dict(self) -> dict:
        """Rank-independent: any rank's copy resumes every rank."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_blocks": self.num_blocks, "global_batch": self.global_batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_blocks", "global_batch", "seq_len"):
            if state[key] != getattr(self, key):
                raise DataError(f"cannot resume the {self.name} data order: the checkpoint has {key}={state[key]}, "
                                f"this run has {getattr(self, key)}; resume with the same data, --seed, --seq-len, "
                                "--max-samples and batch-size x dp-size")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# ----------------------------------------------------------------------------------------------
# entry point


@dataclass
class DataBundle:
    train: BatchLoader
    val: BatchLoader | None  # None with --eval-batches 0 (no evaluation; the training split is the same)
    vocab_size: int  # tokenizer vocab (synthetic: the model's)
    description: str  # one line for logs
    cache_hit: bool  # True when no tokenisation ran in this process (always True for synthetic)


def _check_batches(loader: BatchLoader, n_tokens: int, what: str, max_samples: int | None = None) -> None:
    if len(loader) == 0:
        capped = f" (capped by --max-samples {max_samples})" if max_samples is not None else ""
        raise DataError(
            f"the {what} split has {n_tokens:,} tokens = {loader.num_blocks} blocks{capped} of --seq-len "
            f"{loader.seq_len} (+1), fewer than one batch of batch-size {loader.batch_size} x dp-size "
            f"{loader.dp_size} = {loader.global_batch} blocks; use a smaller --seq-len or --batch-size"
            + (", or a larger --max-samples" if what == "training" else ", or more validation text"))


def _synthetic(cfg: DataConfig, seq_len: int, batch_size: int, vocab: int, dp_size: int, seed: int
               ) -> tuple[np.ndarray, np.ndarray]:
    n_train = cfg.max_samples or max(SYNTHETIC_TRAIN_BLOCKS, batch_size * dp_size)
    n_val = cfg.eval_batches * batch_size * dp_size
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    train = np.random.Generator(np.random.PCG64([seed, 0])).integers(0, vocab, n_train * seq_len + 1, dtype=dtype)
    val = np.random.Generator(np.random.PCG64([seed, 1])).integers(0, vocab, n_val * seq_len + 1, dtype=dtype)
    return train, val


def build_data(cfg: DataConfig, *, seq_len: int, batch_size: int, model_vocab_size: int, dp_rank: int,
               dp_size: int, seed: int, is_main: bool, barrier: Callable[[], None]) -> DataBundle:
    """Tokenise (main process, once per cache key), wait at `barrier`, and return sharded loaders."""
    cache_hit = True
    if cfg.data == "synthetic":
        barrier()
        train_tokens, val_tokens = _synthetic(cfg, seq_len, batch_size, model_vocab_size, dp_size, seed)
        vocab, source = model_vocab_size, f"synthetic (uniform tokens < {model_vocab_size}, seed {seed})"
    else:
        train_split, val_split = resolve_splits(cfg)
        tokenizer = load_tokenizer(cfg.tokenizer)
        vocab = len(tokenizer)
        if vocab > model_vocab_size:
            raise DataError(f"--tokenizer {cfg.tokenizer} has {vocab} tokens but the model's vocab_size is "
                            f"{model_vocab_size}; use a tokenizer with at most {model_vocab_size} tokens")
        eot = eot_token_id(tokenizer)
        key_material = {"tokenizer": tokenizer_fingerprint(tokenizer), "eot": eot,
                        "dtype": "uint16" if vocab <= 2**16 else "uint32"}
        cache_dir = Path(cfg.cache_dir).expanduser()
        splits = [s for s in (train_split, val_split) if s is not None]
        paths = [_cache_paths(s, key_material, cache_dir) for s in splits]
        if is_main:
            try:
                cache_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DataError(f"--cache-dir {cache_dir}: cannot create it ({e.strerror}); pass a writable "
                                "--cache-dir") from None
            for split, (bin_path, material) in zip(splits, paths):
                meta_path = bin_path.with_suffix(".json")
                if meta_path.exists():
                    problem = _cache_problem(bin_path)
                    if problem is None:
                        continue
                    # derived data: rebuilding loses nothing; other ranks wait at the barrier below meanwhile
                    _log.warning("token cache %s is damaged: %s; rebuilding it", bin_path, problem)
                    meta_path.unlink()  # first, so an interrupted rebuild reads as "no cache" next time
                cache_hit = False
                if not os.access(cache_dir, os.W_OK | os.X_OK):  # a read-only cache serves hits only
                    raise DataError(f"--cache-dir {cache_dir} is not writable and holds no token cache for the "
                                    f"{split.name} text ({split.label}); pass a writable --cache-dir, or copy in one "
                                    "built elsewhere (python -m gpt2.data <train.py data flags>)")
                if old := _other_format_sidecars(cache_dir, split.name):
                    _log.warning("token cache: ignoring %s (another cache format than version %d); building %s "
                                 "(delete the old files)", ", ".join(map(str, old)), CACHE_FORMAT_VERSION, bin_path)
                _build_cache(split, bin_path, material, tokenizer, eot, cfg.num_proc)
        barrier()
        streams = [_open_cache(p, s, cfg.data_path, verified=is_main) for s, (p, _) in zip(splits, paths)]
        if val_split is None:
            full = streams[0]
            n_val = int(len(full) * VAL_TAIL_FRACTION)
            train_tokens, val_tokens = full[:len(full) - n_val], full[len(full) - n_val:]
            val_label = f"last {VAL_TAIL_FRACTION:.0%} of train"
        else:
            train_tokens, val_tokens = streams
            val_label = val_split.label
        source = f"train: {train_split.label} | val: {val_label} | tokenizer {cfg.tokenizer} ({vocab} tokens)"
    train = BatchLoader(train_tokens, seq_len=seq_len, batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size,
                        seed=seed, shuffle=True, max_blocks=cfg.max_samples, name="train")
    _check_batches(train, len(train_tokens), "training", cfg.max_samples)
    val = None
    val_text = "no evaluation (--eval-batches 0)"
    if cfg.eval_batches:
        val = BatchLoader(val_tokens, seq_len=seq_len, batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size,
                          seed=seed, shuffle=False, name="validation")
        _check_batches(val, len(val_tokens), "validation")
        val_text = f"val {len(val_tokens):,} tokens, {val.num_blocks:,} blocks, {len(val)} batches"
    description = (f"{source} | train {len(train_tokens):,} tokens, {train.num_blocks:,} blocks, {len(train)} "
                   f"batches/epoch/rank | {val_text} | cache {'hit' if cache_hit else 'built'}")
    return DataBundle(train=train, val=val, vocab_size=vocab, description=description, cache_hit=cache_hit)

