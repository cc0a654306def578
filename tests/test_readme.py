"""The README is the front door: it documents every flag, and CI runs the test command it names."""

from __future__ import annotations

import re
from pathlib import Path

from gpt2.config.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_every_cli_flag_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    flags = {opt for action in build_parser()._actions for opt in action.option_strings
             if opt.startswith("--") and opt not in ("--help", "--local_rank", "--local-rank")}
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", readme))
    assert not missing, f"README.md does not mention: {missing}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
