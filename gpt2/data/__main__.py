"""`python -m gpt2.data <train.py flags>`: pre-build the token cache a run with those flags reads, e.g. on a
machine with `datasets` and the network, to copy its `--cache-dir` to one without."""

from __future__ import annotations

from gpt2.config.cli import parse_args
from gpt2.config.schema import ConfigError
from gpt2.data.loader import build_data


def main(argv: list[str] | None = None) -> None:
    """Pre-build the token cache with train.py's flags: `python -m gpt2.data --data-path ... --seq-len ...`."""
    try:
        cfg = parse_args(argv)
        bundle = build_data(cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
                            model_vocab_size=cfg.model.vocab_size, dp_rank=0, dp_size=1, seed=cfg.train.seed,
                            is_main=True, barrier=lambda: None)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    print(bundle.description)


if __name__ == "__main__":
    main()
