"""Tokenizer loading and the Hugging Face hub reachability check.

`--tokenizer` is one of:
  * a `tokenizer.json` file          -> `PreTrainedTokenizerFast(tokenizer_file=...)`
  * a tokenizer folder               -> `AutoTokenizer.from_pretrained(folder)`
  * a hub name (`gpt2`, `org/name`)  -> the local hub cache first, then the hub.

Without a route to the hub, `huggingface_hub` retries for ~50 s before it gives up. We therefore
probe the hub with a short TCP connect (`hub_reachable`, 3 s, through HTTPS_PROXY when set;
HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 mean "unreachable" without probing) and raise a
`DataError` that lists the offline options instead of waiting.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from gpt2.config import ConfigError

EOT_TOKEN = "<|endoftext|>"
HUB_PROBE_TIMEOUT_S = 3.0


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
    """True when a TCP connection to the hub (or the HTTPS proxy) opens within `timeout` seconds.

    The connect runs in a daemon thread so that a stalled DNS lookup cannot block us either.
    """
    if endpoint is None:
        if _hub_offline_flag():
            return False
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlsplit(proxy or endpoint)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if not host:
        return False
    ok: list[bool] = []

    def probe() -> None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
            ok.append(True)

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

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def load_tokenizer(spec: str):
    """A fast (Rust-backed) `transformers` tokenizer from a file, a folder or a hub name."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(spec).expanduser()
    try:
        if path.is_file():
            tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
        elif path.is_dir():
            tok = AutoTokenizer.from_pretrained(str(path))
        elif spec.endswith(".json") or spec.startswith((".", "/", "~")):
            raise DataError(f"--tokenizer {spec}: no such file or folder")
        else:
            tok = _load_hub_tokenizer(spec)
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"--tokenizer {spec}: could not load it ({e})") from e
    if not tok.is_fast:
        raise DataError(f"--tokenizer {spec}: a fast (tokenizer.json) tokenizer is required")
    return tok


def _load_hub_tokenizer(name: str):
    from transformers import AutoTokenizer

    with contextlib.suppress(OSError, ValueError):
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    if not hub_reachable():
        raise DataError(offline_message(f"tokenizer {name!r} (--tokenizer)"))
    return AutoTokenizer.from_pretrained(name)


def eot_token_id(tok) -> int:
    """The document separator: the tokenizer's EOS token, else `<|endoftext|>`."""
    if tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    token_id = tok.convert_tokens_to_ids(EOT_TOKEN)
    if token_id is None or token_id == tok.unk_token_id:
        raise DataError(f"the tokenizer has neither an EOS token nor {EOT_TOKEN}; documents cannot be separated")
    return int(token_id)


def tokenizer_fingerprint(tok) -> str:
    """sha256 of the serialised Rust tokenizer (vocab, merges, normaliser, added tokens): same tokens iff same hash."""
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()
