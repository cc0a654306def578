"""Data pipeline: packing, DP sharding, determinism, resume, token cache, sources, bad input, offline errors.

Always-run tests build tiny WikiText-like corpora and a tiny byte-level BPE in tmp_path; the tests that
need the real GPT-2 tokenizer / WikiText-2 read ../shared/data and skip when it is absent.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import gpt2.data.loader
from gpt2.config.schema import ConfigError, DataConfig
from gpt2.data.loader import BatchLoader, DataError, build_data, resolve_splits
from gpt2.data.tokenizer import hub_reachable, load_tokenizer
from parallel.dims import ParallelDims

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
GPT2_TOKENIZER = SHARED / "gpt2-tokenizer" / "tokenizer.json"
WIKITEXT2 = SHARED / "wikitext-2"
needs_shared = pytest.mark.skipif(not GPT2_TOKENIZER.exists() or not WIKITEXT2.exists(),
                                  reason=f"{SHARED} (offline GPT-2 tokenizer + WikiText-2) is absent")
EOT = "<|endoftext|>"
WORDS = ["the", "a", "lobster", "sea", "claw", "blue", "red", "year", "larva", "species", "food", "pot", "river",
         "city", "war", "game", "album", "song"]


def wiki_lines(n_articles: int, seed: int) -> list[str]:
    """WikiText-raw-like lines: blank rows, top-level titles, section headings, paragraphs."""
    rng = np.random.default_rng(seed)
    lines: list[str] = []
    for a in range(n_articles):
        lines += [" \n", f" = Article {a} {WORDS[a % len(WORDS)]} = \n", " \n"]
        for s in range(2):
            para = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 30))))
            lines += [f" {para} . \n", " \n", f" = = Section {s} = = \n", " \n"]
    return lines


def write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE (~300 tokens, <|endoftext|> = 0) trained on the corpus style, as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(wiki_lines(20, seed=0), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def reference_stream(tokenizer_file: Path, lines: list[str]) -> np.ndarray:
    """Independent tokenisation: the raw `tokenizers` library, one line at a time, EOT before titles."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    eot = tok.token_to_id(EOT)
    out: list[int] = []
    for line in lines:
        if line.startswith(" = ") and not line.startswith(" = = "):
            out.append(eot)
        out += tok.encode(line, add_special_tokens=False).ids
    return np.array(out, dtype=np.int64)


def build(cfg: DataConfig, **kw):
    args = dict(seq_len=16, batch_size=2, model_vocab_size=50257, dp_rank=0, dp_size=1, seed=0,
                is_main=True, barrier=lambda: None)
    return build_data(cfg, **{**args, **kw})


def stream(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64).astype(np.uint16)


def stream_blocks(loader: BatchLoader) -> list[int]:
    """Block numbers read off the batches of one epoch over an arange stream (first token / T)."""
    return [int(v) // loader.seq_len for x, _ in loader.iter_epoch() for v in x[:, 0]]


def epoch_blocks(loader: BatchLoader) -> list[int]:
    """Block numbers of one epoch as the loader reports them."""
    return [int(b) for i in range(len(loader)) for b in loader.block_indices(loader.epoch, i)]


# ---------------------------------------------------------------------------------------------- loader


@pytest.mark.parametrize("shuffle", [False, True])
def test_packing_blocks_and_shift(shuffle):
    T, n = 8, 8 * 50 + 5
    loader = BatchLoader(stream(n), seq_len=T, batch_size=3, dp_rank=0, dp_size=1, seed=1, shuffle=shuffle)
    assert loader.num_blocks == (n - 1) // T and len(loader) == loader.num_blocks // 3
    for x, y in loader.iter_epoch():
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, T)
        assert torch.equal(x[:, 0] % T, torch.zeros(3, dtype=torch.int64))  # blocks start at multiples of T
        assert torch.equal(x, x[:, :1] + torch.arange(T))  # contiguous tokens of the stream
        assert torch.equal(y, x + 1)  # y is x shifted by one token
    if not shuffle:
        assert stream_blocks(loader) == list(range(len(loader) * 3))
    assert stream_blocks(loader) == epoch_blocks(loader)


def test_sharding_disjoint_equal_and_tp_ranks_agree():
    T, B, tp, dp = 4, 2, 2, 3
    tokens = stream(4 * 61 + 1)  # 61 blocks: ragged tail of 61 % 6 = 1
    per_dp: dict[int, list[int]] = {}
    for rank in range(tp * dp):
        dims = ParallelDims(world_size=tp * dp, rank=rank, tp_size=tp)
        loader = BatchLoader(tokens, seq_len=T, batch_size=B, dp_rank=dims.dp_rank, dp_size=dims.dp_size,
                             seed=7, shuffle=True)
        blocks = stream_blocks(loader)
        if dims.dp_rank in per_dp:
            assert blocks == per_dp[dims.dp_rank]  # TP peers see the same batches
        per_dp[dims.dp_rank] = blocks
    counts = {len(b) for b in per_dp.values()}
    assert counts == {61 // (B * dp) * B}  # equal counts, ragged tail dropped
    union = [b for blocks in per_dp.values() for b in blocks]
    assert len(set(union)) == len(union) == 60 and set(union) <= set(range(61))


def test_global_batches_depend_on_batch_times_dp_only():
    tokens = stream(4 * 64 + 1)
    single = BatchLoader(tokens, seq_len=4, batch_size=4, dp_rank=0, dp_size=1, seed=3, shuffle=True)
    ranks = [BatchLoader(tokens, seq_len=4, batch_size=2, dp_rank=r, dp_size=2, seed=3, shuffle=True) for r in (0, 1)]
    for _ in range(len(single) + 3):  # across an epoch boundary
        x, y = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))


def test_order_deterministic_per_seed_and_epoch():
    tokens = stream(4 * 40 + 1)

    def make(seed):
        return BatchLoader(tokens, seq_len=4, batch_size=2, dp_rank=0, dp_size=1, seed=seed, shuffle=True)

    a, b, c = make(5), make(5), make(6)
    epoch0 = [a.next_batch()[0] for _ in range(len(a))]
    assert all(torch.equal(x, b.next_batch()[0]) for x in epoch0)
    epoch1 = [a.next_batch()[0] for _ in range(len(a))]
    assert a.epoch == 1
    assert not torch.equal(torch.cat(epoch0), torch.cat(epoch1))  # new permutation per epoch
    assert sorted(torch.cat(epoch0)[:, 0].tolist()) == sorted(torch.cat(epoch1)[:, 0].tolist())
    assert not torch.equal(torch.cat(epoch0), torch.cat([c.next_batch()[0] for _ in range(len(c))]))


def test_state_dict_resume_continues_exactly():
    tokens = stream(4 * 30 + 1)
    kw = dict(seq_len=4, batch_size=3, dp_rank=1, dp_size=2, seed=11, shuffle=True)
    ref = BatchLoader(tokens, **kw)
    expected = [ref.next_batch() for _ in range(12)]  # 5 batches per epoch: crosses two epoch boundaries
    run = BatchLoader(tokens, **kw)
    for _ in range(7):
        run.next_batch()
    state = run.state_dict()
    resumed = BatchLoader(tokens, **kw)
    resumed.load_state_dict(state)
    for x, y in expected[7:]:
        rx, ry = resumed.next_batch()
        assert torch.equal(rx, x) and torch.equal(ry, y)
    other = BatchLoader(tokens, **{**kw, "seed": 12})
    with pytest.raises(DataError, match="seed"):
        other.load_state_dict(state)


# ---------------------------------------------------------------------------------------------- sources


@pytest.mark.parametrize("names, train, val", [
    (["train.txt", "valid.txt", "test.txt"], ["train.txt"], ["valid.txt"]),
    (["train.txt", "test.txt"], ["train.txt"], ["test.txt"]),
    (["valid.txt", "test.txt"], ["valid.txt"], ["test.txt"]),  # the WikiText-2 layout in ../shared/data
    (["wiki.train.raw", "wiki.valid.raw", "wiki.test.raw"], ["wiki.train.raw"], ["wiki.valid.raw"]),
    (["train_00.txt", "train_01.txt", "dev.txt", "notes.md"], ["train_00.txt", "train_01.txt"], ["dev.txt"]),
    (["a.txt", "b.txt"], ["a.txt", "b.txt"], None),  # no roles: all train, tail for validation
    (["corpus.txt", "test.txt"], ["corpus.txt"], ["test.txt"]),  # role-less text trains when there is no train*
    (["corpus.txt", "valid.txt", "test.txt"], ["corpus.txt"], ["valid.txt"]),
    (["train.txt"], ["train.txt"], None),
])
def test_folder_rules(tmp_path, names, train, val):
    for name in names:
        write(tmp_path / name, ["x\n"])
    tr, va = resolve_splits(DataConfig(data_path=str(tmp_path)))
    assert [f.name for f in tr.files] == train
    assert (va and [f.name for f in va.files]) == val


def test_every_file_of_the_folder_is_used_or_named(tmp_path, caplog):
    for name in ("train.txt", "valid.txt", "test.txt", "notes.txt", "readme.md", "more/train_2.txt"):
        write(tmp_path / name, ["x\n"])
    with caplog.at_level("WARNING", logger="gpt2"):
        resolve_splits(DataConfig(data_path=str(tmp_path)))
    assert caplog.messages == [
        f"--data-path {tmp_path}: not used: notes.txt (no train/valid/test in its name, and train* files are the "
        "training text); test.txt (test text is held out when valid* files validate); more (a folder: not "
        "searched); readme.md (not .txt/.raw/.tokens)"]


def test_local_folder_stream_matches_reference_and_tail_split(tmp_path, tiny_tokenizer):
    lines = wiki_lines(30, seed=1)
    write(tmp_path / "corpus" / "data.txt", lines)
    cfg = DataConfig(data_path=str(tmp_path / "corpus"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"), num_proc=1)
    bundle = build(cfg)
    ref = reference_stream(tiny_tokenizer, lines)
    full = np.concatenate([bundle.train.tokens, bundle.val.tokens]).astype(np.int64)
    assert np.array_equal(full, ref)
    assert len(bundle.val.tokens) == int(len(ref) * 0.05)  # the tail split
    assert bundle.vocab_size == len(load_tokenizer(str(tiny_tokenizer)))
    assert int((full == 0).sum()) == 30  # one EOT per article
    no_eval = build(replace(cfg, eval_batches=0))  # no evaluation: the validation tail stays out of training
    assert no_eval.val is None and "no evaluation (--eval-batches 0)" in no_eval.description
    assert np.array_equal(no_eval.train.tokens, bundle.train.tokens)


def test_multiprocess_tokenisation_and_cache_reuse(tmp_path, tiny_tokenizer, monkeypatch):
    train_lines, val_lines = wiki_lines(250, seed=2), wiki_lines(20, seed=3)  # > 2000 rows: 2 workers
    write(tmp_path / "corpus" / "train.txt", train_lines)
    write(tmp_path / "corpus" / "valid.txt", val_lines)
    cfg = DataConfig(data_path=str(tmp_path / "corpus"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"), num_proc=2)
    first = build(cfg)
    assert not first.cache_hit and "cache built" in first.description
    assert np.array_equal(np.asarray(first.train.tokens, dtype=np.int64), reference_stream(tiny_tokenizer, train_lines))
    assert np.array_equal(np.asarray(first.val.tokens, dtype=np.int64), reference_stream(tiny_tokenizer, val_lines))
    assert first.train.tokens.dtype == np.uint16

    def no_tokenising(*args, **kwargs):
        raise AssertionError("tokenised again although the cache should hit")

    monkeypatch.setattr("gpt2.data.loader._build_cache", no_tokenising)
    start = time.perf_counter()
    second = build(cfg, seq_len=32)  # the cache key does not depend on seq_len
    assert second.cache_hit and time.perf_counter() - start < 5
    assert np.array_equal(second.train.tokens, first.train.tokens)

    monkeypatch.undo()
    write(tmp_path / "corpus" / "train.txt", train_lines[:-4])  # changed source -> new key, rebuilt
    third = build(cfg)
    assert not third.cache_hit and len(third.train.tokens) < len(first.train.tokens)


def test_non_main_ranks_wait_for_the_main_process(tmp_path, tiny_tokenizer):
    write(tmp_path / "corpus.txt", wiki_lines(30, seed=4))
    cfg = DataConfig(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"), num_proc=1)
    barrier = threading.Barrier(2, timeout=60)
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            results[r] = build(cfg, dp_rank=r, dp_size=2, batch_size=1, is_main=r == 0, barrier=barrier.wait)
        except Exception as e:  # noqa: BLE001 - surfaced by the assertion below
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]  # the non-main rank starts first
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(not isinstance(v, Exception) for v in results.values()), results
    assert np.array_equal(results[0].train.tokens, results[1].train.tokens)
    assert not set(epoch_blocks(results[0].train)) & set(epoch_blocks(results[1].train))
    with pytest.raises(DataError, match="missing after the main process"):
        build(DataConfig(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tiny_tokenizer),
                         cache_dir=str(tmp_path / "elsewhere")), is_main=False)


@pytest.mark.parametrize(("damage", "problem"), [
    # a partial copy of --cache-dir: numpy's memmap used to fail with "mmap length is greater than file size"
    ("truncate", "bytes but its sidecar says"),
    # the right size, other content (token ids beyond the vocabulary): an IndexError mid-training, a device-side
    # assert on a GPU, unless the sidecar's sha256 catches it on open
    ("garbage", "does not match the sha256 in its sidecar"),
])
def test_a_damaged_token_cache_is_refused_or_rebuilt_with_a_warning(tmp_path, tiny_tokenizer, caplog, damage: str,
                                                                    problem: str):
    lines = wiki_lines(30, seed=6)
    write(tmp_path / "corpus.txt", lines)
    cfg = DataConfig(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"), num_proc=1)
    build(cfg)
    (bin_path,) = (tmp_path / "cache").glob("train-*.bin")
    full_size = bin_path.stat().st_size
    if damage == "truncate":
        with open(bin_path, "r+b") as f:
            f.truncate(full_size // 2)
    else:
        bin_path.write_bytes(np.full(full_size // 2, 65535, dtype=np.uint16).tobytes())

    with pytest.raises(DataError, match=f"{bin_path.name} is damaged: .*{problem}.*delete {bin_path}"):
        build(cfg, is_main=False)  # a rank that does not rebuild names the file to delete

    with caplog.at_level("WARNING", logger="gpt2"):
        rebuilt = build(cfg)
    assert not rebuilt.cache_hit
    assert str(bin_path) in caplog.text and problem in caplog.text and "rebuilding" in caplog.text
    assert bin_path.stat().st_size == full_size
    full = np.concatenate([rebuilt.train.tokens, rebuilt.val.tokens]).astype(np.int64)
    assert np.array_equal(full, reference_stream(tiny_tokenizer, lines))


# Loads data in a process where `import datasets` fails (as on a GPU machine without it): argv is
# data_path tokenizer cache_dir; prints whether the cache hit and the train + val tokens.
_NO_DATASETS_LOAD = textwrap.dedent("""
    import json, sys
    sys.modules["datasets"] = None  # any `import datasets` now raises ImportError
    from gpt2.config.schema import DataConfig
    from gpt2.data.loader import DataError, build_data
    cfg = DataConfig(data_path=sys.argv[1], tokenizer=sys.argv[2], cache_dir=sys.argv[3], num_proc=1)
    try:
        b = build_data(cfg, seq_len=16, batch_size=2, model_vocab_size=50257, dp_rank=0, dp_size=1, seed=0,
                       is_main=True, barrier=lambda: None)
    except DataError as e:
        print(json.dumps({"error": str(e)}))
    else:
        print(json.dumps({"hit": b.cache_hit, "train": b.train.tokens.tolist(), "val": b.val.tokens.tolist()}))
""")


def load_without_datasets(data_path: Path, tokenizer: Path, cache_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _NO_DATASETS_LOAD, str(data_path), str(tokenizer), str(cache_dir)],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cache_travels_by_content_and_a_hit_needs_no_datasets(tmp_path, tiny_tokenizer):
    """A --cache-dir built here is a hit for the same text + tokenizer copied elsewhere, without `datasets`."""
    here = tmp_path / "machine-a"
    write(here / "corpus" / "train.txt", wiki_lines(30, seed=9))
    write(here / "corpus" / "valid.txt", wiki_lines(8, seed=10))
    shutil.copy(tiny_tokenizer, here / "tokenizer.json")
    built = build(DataConfig(data_path=str(here / "corpus"), tokenizer=str(here / "tokenizer.json"),
                             cache_dir=str(here / "cache"), num_proc=1))
    assert not built.cache_hit

    there = tmp_path / "machine-b" / "elsewhere"  # other paths, other mtimes, the original gone
    shutil.copytree(here / "corpus", there / "text", copy_function=shutil.copy)
    shutil.copy(here / "tokenizer.json", there / "gpt2.json")
    shutil.copytree(here / "cache", there / "carried-cache", copy_function=shutil.copy)
    for f in (there / "text").iterdir():
        os.utime(f, ns=(1, 1))
    shutil.rmtree(here)

    loaded = load_without_datasets(there / "text", there / "gpt2.json", there / "carried-cache")
    assert loaded.get("hit") is True, loaded
    assert loaded["train"] == built.train.tokens.tolist() and loaded["val"] == built.val.tokens.tolist()
    missing = load_without_datasets(there / "text", there / "gpt2.json", there / "empty-cache")
    assert "needs the `datasets` package" in missing.get("error", ""), missing


def test_cache_of_another_format_is_not_read_and_is_named(tmp_path, tiny_tokenizer, caplog):
    corpus = write(tmp_path / "corpus.txt", wiki_lines(30, seed=11))
    cfg = DataConfig(data_path=str(corpus), tokenizer=str(tiny_tokenizer), cache_dir=str(tmp_path / "cache"),
                     num_proc=1)
    build(cfg)
    (current,) = (tmp_path / "cache").glob("train-*.json")
    old = tmp_path / "cache" / "train-0123456789abcdef0123.json"  # a version-1 cache (keyed by path + mtime)
    old.with_suffix(".bin").write_bytes(np.zeros(4, dtype=np.uint16).tobytes())
    old.write_text(json.dumps({"version": 1, "source": {"files": [[str(corpus), 1, 1]]}, "dtype": "uint16",
                               "n_tokens": 4, "n_text_rows": 1, "n_rows": 1}))
    write(corpus, wiki_lines(31, seed=11))  # new text: a miss, built next to both caches
    with caplog.at_level("WARNING", logger="gpt2"):
        bundle = build(cfg)
    assert not bundle.cache_hit and len(bundle.train.tokens) > 4
    assert f"ignoring {old} (another cache format" in caplog.text
    assert str(current) not in caplog.text  # a current-format cache of other text is not called old


def test_max_samples_caps_training_blocks_before_sharding(tmp_path, tiny_tokenizer):
    write(tmp_path / "corpus.txt", wiki_lines(30, seed=5))
    cfg = DataConfig(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"), num_proc=1, max_samples=12)
    loaders = [build(cfg, dp_rank=r, dp_size=2, batch_size=2).train for r in (0, 1)]
    assert all(lo.num_blocks == 12 and len(lo) == 3 for lo in loaders)
    blocks = epoch_blocks(loaders[0]) + epoch_blocks(loaders[1])
    assert sorted(blocks) == list(range(12))


def test_synthetic_is_deterministic_per_seed(tmp_path):
    cfg = DataConfig(data="synthetic", cache_dir=str(tmp_path / "cache"), eval_batches=2)
    a, b = build(cfg, seed=1), build(cfg, seed=1)
    c = build(cfg, seed=2)
    xa, xb, xc = a.train.next_batch()[0], b.train.next_batch()[0], c.train.next_batch()[0]
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    assert a.vocab_size == 50257 and int(xa.max()) < 50257 and a.cache_hit
    assert len(a.val) == 2 and not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------------------------- bad input


def test_data_error_is_a_config_error():
    assert issubclass(DataError, ConfigError)


@pytest.mark.parametrize("layout", ["missing", "empty_folder", "no_text_files", "empty_file", "blank_file"])
def test_bad_data_path_names_the_path(tmp_path, tiny_tokenizer, layout):
    path = tmp_path / "data"
    if layout == "empty_folder":
        path.mkdir()
    elif layout == "no_text_files":
        write(path / "readme.md", ["hello\n"])
    elif layout == "empty_file":
        path = write(tmp_path / "data.txt", [])
    elif layout == "blank_file":
        path = write(tmp_path / "data.txt", [" \n"] * 50)
    cfg = DataConfig(data_path=str(path), tokenizer=str(tiny_tokenizer), cache_dir=str(tmp_path / "cache"), num_proc=1)
    with pytest.raises(DataError, match=f"--data-path {path}"):
        build(cfg)


@pytest.mark.parametrize(("content", "needle"), [
    (b"caf\xe9 au lait\n" * 50, "is not UTF-8 text (byte 3: invalid continuation byte)"),  # latin-1
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "is not UTF-8 text (byte 0: invalid start byte)"),
    (b"text\x00\x01 and more\n" * 50, "is binary, not text (a NUL byte at 4)"),
    (b"cut mid-character \xe2\x82", "is not UTF-8 text (it ends inside a character)"),
])
def test_a_file_that_is_not_utf8_text_is_named(tmp_path, tiny_tokenizer, content: bytes, needle: str):
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "train.txt", wiki_lines(5, seed=6))
    (tmp_path / "data" / "valid.txt").write_bytes(content)
    cfg = DataConfig(data_path=str(tmp_path / "data"), tokenizer=str(tiny_tokenizer), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=re.escape(f"--data-path: {tmp_path / 'data' / 'valid.txt'} {needle}")):
        build(cfg)


def test_a_device_as_data_path_is_named(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match="--data-path /dev/null: not a regular file or a folder"):
        build(DataConfig(data_path="/dev/null", tokenizer=str(tiny_tokenizer), cache_dir=str(tmp_path / "c")))


@pytest.mark.parametrize("content", ['{"a": 1}', "not json at all", ""])
def test_a_file_that_is_not_a_tokenizer_is_named(tmp_path, content: str):
    (tmp_path / "tok.json").write_text(content)
    with pytest.raises(DataError, match=f"--tokenizer {tmp_path / 'tok.json'}: not a tokenizer"):
        load_tokenizer(str(tmp_path / "tok.json"))


def test_a_read_only_cache_dir_serves_hits_and_names_a_miss(tmp_path, tiny_tokenizer, monkeypatch):
    write(tmp_path / "corpus.txt", wiki_lines(5, seed=6))
    cfg = DataConfig(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"), num_proc=1)
    build(cfg)
    # read-only for this user (tests run as root)
    monkeypatch.setattr(gpt2.data.loader.os, "access", lambda path, mode: False)
    assert build(cfg).cache_hit
    write(tmp_path / "corpus.txt", wiki_lines(6, seed=7))  # other text: a miss
    with pytest.raises(DataError, match=f"--cache-dir {tmp_path / 'cache'} is not writable and holds no token cache"):
        build(cfg)


def test_a_full_disk_while_building_the_cache_leaves_nothing_behind(tmp_path, tiny_tokenizer, monkeypatch):
    """The token array's write refused (ENOSPC, after part of it was written): one line naming the file (train.py
    exits 74 on WriteFailed), and the cache dir is left as it was, no partial array or tokenised rows in it."""
    from gpt2.observe.run_logging import WriteFailed

    write(tmp_path / "corpus.txt", wiki_lines(5, seed=6))
    cfg = DataConfig(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"), num_proc=1)

    def full_disk(path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 64)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gpt2.data.loader.np, "memmap", full_disk)
    with pytest.raises(WriteFailed, match=r"no space left on device while writing .*train-\w+\.bin; free space"):
        build(cfg)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_tokenizer_larger_than_model_vocab(tmp_path, tiny_tokenizer):
    write(tmp_path / "corpus.txt", wiki_lines(5, seed=6))
    n = len(load_tokenizer(str(tiny_tokenizer)))
    cfg = DataConfig(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=rf"{n} tokens.*vocab_size is 100\b"):
        build(cfg, model_vocab_size=100)


def test_missing_tokenizer_file(tmp_path):
    write(tmp_path / "corpus.txt", wiki_lines(5, seed=6))
    with pytest.raises(DataError, match="nope.json: could not load it \\(no such tokenizer file"):
        build(DataConfig(data_path=str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path / "nope.json")))


def test_seq_len_leaving_no_validation_block(tmp_path, tiny_tokenizer):
    write(tmp_path / "corpus" / "train.txt", wiki_lines(40, seed=7))
    write(tmp_path / "corpus" / "valid.txt", wiki_lines(1, seed=8))
    cfg = DataConfig(data_path=str(tmp_path / "corpus"), tokenizer=str(tiny_tokenizer),
                     cache_dir=str(tmp_path / "cache"), num_proc=1)
    with pytest.raises(DataError, match=r"validation split has .* --seq-len 512"):
        build(cfg, seq_len=512)


# ---------------------------------------------------------------------------------------------- hub / offline


def test_hub_probe_never_hangs(monkeypatch):
    def stalled(*args, **kwargs):
        time.sleep(30)  # a connect, DNS lookup or TLS handshake that never completes...
        raise TimeoutError  # ...and then fails as urllib would (a stub returning None breaks the probe thread)

    monkeypatch.setattr("urllib.request.urlopen", stalled)
    start = time.perf_counter()
    assert not hub_reachable("https://huggingface.co", timeout=0.5)
    assert time.perf_counter() - start < 2
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert not hub_reachable()


@pytest.fixture
def no_hub():
    if hub_reachable():
        pytest.skip("the Hugging Face hub is reachable from here")


def assert_offline_message(err: DataError) -> None:
    for option in ("--data-path", "--tokenizer <path", "--data synthetic"):
        assert option in str(err)


def test_hub_tokenizer_offline_fails_fast(no_hub):
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache("gpt2", "tokenizer.json"), str):
        pytest.skip("gpt2 tokenizer is in the local hub cache")
    start = time.perf_counter()
    with pytest.raises(DataError) as info:
        load_tokenizer("gpt2")
    assert time.perf_counter() - start < 15
    assert_offline_message(info.value)


def test_hub_dataset_offline_fails_fast(no_hub, tmp_path, tiny_tokenizer):
    import datasets

    if any(Path(datasets.config.HF_DATASETS_CACHE).glob("wikitext*")):
        pytest.skip("wikitext is in the local datasets cache")
    start = time.perf_counter()
    with pytest.raises(DataError) as info:
        build(DataConfig(tokenizer=str(tiny_tokenizer), cache_dir=str(tmp_path / "cache")))
    assert time.perf_counter() - start < 15
    assert_offline_message(info.value)
    assert "wikitext" in str(info.value)


def test_hub_tokenizer_from_local_hub_cache_without_network(tmp_path, tiny_tokenizer, monkeypatch):
    """A hub name whose files are in the hub cache loads offline (HF_HUB_OFFLINE: no probe, no download)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--test-org--tiny-bpe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes(tiny_tokenizer.read_bytes())
    (snapshot / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    tok = load_tokenizer("test-org/tiny-bpe")
    assert len(tok) == len(load_tokenizer(str(tiny_tokenizer))) and tok.eos_token_id == 0
    with pytest.raises(DataError, match="--data synthetic"):
        load_tokenizer("test-org/not-cached")


# ---------------------------------------------------------------------------------------------- WikiText-2


@needs_shared
def test_wikitext2_end_to_end(tmp_path):
    cfg = DataConfig(data_path=str(WIKITEXT2), tokenizer=str(GPT2_TOKENIZER), cache_dir=str(tmp_path / "cache"),
                     num_proc=1)
    bundle = build(cfg, seq_len=128, batch_size=4)
    assert bundle.vocab_size == 50257
    valid_lines = (WIKITEXT2 / "valid.txt").read_text().splitlines(keepends=True)
    train = np.asarray(bundle.train.tokens, dtype=np.int64)
    assert np.array_equal(train, reference_stream(GPT2_TOKENIZER, valid_lines))
    n_val = len(bundle.val.tokens)
    assert 250_000 < len(bundle.train.tokens) < 270_000 and 285_000 < n_val < 305_000  # README: ~555k together
    x, y = bundle.train.next_batch()
    assert x.shape == (4, 128) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(bundle.val) == (n_val - 1) // 128 // 4
    assert int(bundle.train.tokens[2]) == 50256  # " \n" then EOT before " = Homarus gammarus = "
