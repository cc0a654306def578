"""Tokenizer loading and the Hugging Face hub reachability check.

`--tokenizer` is one of:
  * a `tokenizer.json` file          -> `PreTrainedTokenizerFast(tokenizer_file=...)`
  * a folder with tokenizer.json or tokenizer_config.json -> `AutoTokenizer.from_pretrained(folder)`
  * otherwise a hub name (`gpt2`, `org/name`) -> its tokenizer files from the local hub cache, else
    downloaded, then `AutoTokenizer.from_pretrained(snapshot folder)`.

Without a route to the hub, `huggingface_hub` retries for ~50 s before it gives up. We therefore
probe the hub with one short HTTP request (`hub_reachable`, 3 s, through HTTPS_PROXY when set;
HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 mean "unreachable" without probing) and raise a
`DataError` that lists the offline options instead of waiting.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from gpt2.config.schema import ConfigError

EOT_TOKEN = "<|endoftext|>"
HUB_PROBE_TIMEOUT_S = 3.0
TOKENIZER_FOLDER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
HUB_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                       "merges.txt", "config.json"]


class DataError(ConfigError):
    """A user-facing data/tokenizer error; the message names the flag that fixes it."""


def offline_message(what: str) -> str:
    return (f"cannot load {what}: the Hugging Face hub is unreachable (or offline mode is on) and it is not in "
            "the local hub cache. Offline options: --data-path <text file or folder with train/valid/test .txt> "
            "for local text, --tokenizer <path to tokenizer.json or a tokenizer folder>, or --data synthetic for "
            "random tokens.")


def _hub_offline_flag() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    return os.environ.get("HF_DATASETS_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def hub_reachable(endpoint: str | None = None, timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """True when the hub answers an HTTP HEAD (any status) within `timeout` seconds.

    An HTTP answer, not a bare TCP connect, because some networks accept every connect and then stall.
    `urllib` honours HTTPS_PROXY; the request runs in a daemon thread so a stalled DNS lookup or TLS
    handshake cannot block us beyond `timeout` either.
    """
    if endpoint is None:
        if _hub_offline_flag():
            return False
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    ok: list[bool] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout):
                ok.append(True)
        except urllib.error.HTTPError:  # an HTTP status: the server is there
            ok.append(True)
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


@contextlib.contextmanager
def hub_cache_only() -> Iterator[None]:
    """Make `datasets`/`huggingface_hub` read only their local caches for the duration.

    Their offline switches are read from the environment at import time, so the module flags are
    flipped here (and restored) to get the cache-only path instead of ~50 s of retries.
    """
    import datasets
    from huggingface_hub import constants

    # older `datasets` also read their own HF_DATASETS_OFFLINE copy
    names = [n for n in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(datasets.config, n)]
    flags = [(constants, "HF_HUB_OFFLINE")] + [(datasets.config, n) for n in names]
    saved = [getattr(module, name) for module, name in flags]
    for module, name in flags:
        setattr(module, name, True)
    try:
        yield
    finally:
        for (module, name), value in zip(flags, saved):
            setattr(module, name, value)


def load_tokenizer(spec: str):
    """A fast (Rust-backed) `transformers` tokenizer from a file, a folder or a hub name."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(spec).expanduser()
    try:
        if path.is_file() or (path.is_dir() and any((path / f).exists() for f in TOKENIZER_FOLDER_MARKERS)):
            try:
                tok = (PreTrainedTokenizerFast(tokenizer_file=str(path)) if path.is_file()
                       else AutoTokenizer.from_pretrained(str(path)))
            except Exception as e:  # the Rust `tokenizers` parser raises a bare Exception for a file it cannot read
                raise DataError(f"--tokenizer {spec}: not a tokenizer ({str(e).splitlines()[0] if str(e) else e!r}); "
                                "pass a tokenizers JSON file (tokenizer.json), a folder holding one, or a hub "
                                "name") from e
        elif path.is_absolute() or spec.startswith(("./", "../", "~")) or spec.endswith(".json"):
            raise FileNotFoundError("no such tokenizer file, or a folder without tokenizer.json/tokenizer_config.json")
        else:
            # a hub name; resolved to its snapshot folder so that a same-named local folder (e.g. this
            # repo's `gpt2/` package) is never mistaken for it
            tok = AutoTokenizer.from_pretrained(_hub_tokenizer_folder(spec))
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer {spec}: could not load it ({e})") from e
    if not tok.is_fast:
        raise DataError(f"--tokenizer {spec}: a fast (tokenizer.json) tokenizer is required")
    return tok


def _hub_tokenizer_folder(name: str) -> str:
    """The local snapshot folder of a hub tokenizer: the hub cache first, then a download."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    with contextlib.suppress(LocalEntryNotFoundError):
        return snapshot_download(name, allow_patterns=HUB_TOKENIZER_FILES, local_files_only=True)
    if not hub_reachable():
        raise DataError(offline_message(f"tokenizer {name!r} (--tokenizer)"))
    return snapshot_download(name, allow_patterns=HUB_TOKENIZER_FILES)


def eot_token_id(tok) -> int:
    """The document separator: the tokenizer's EOS token, else `<|endoftext|>`."""
    if tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    token_id = tok.convert_tokens_to_ids(EOT_TOKEN)
    if token_id is None or token_id == tok.unk_token_id:
        raise DataError(f"the tokenizer has neither an EOS token nor {EOT_TOKEN}; documents cannot be separated")
    return int(token_id)


def tokenizer_fingerprint(tok) -> str:
    """sha256 of the serialised Rust tokenizer (vocab, merges, normaliser, added tokens): same tokens iff same hash.

    Content only, never the file's path: a copied tokenizer.json keys the same token cache.
    """
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()
