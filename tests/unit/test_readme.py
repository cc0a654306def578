"""The README is the front door and docs/ holds the rest: the flags page is train.py's --help as generated from the
config schema and describes every flag, CI runs the test command the README names, and every link resolves."""

from __future__ import annotations

import re
from pathlib import Path

from gpt2.config.cli import build_parser, flags_page

ROOT = Path(__file__).resolve().parents[2]
FLAGS_PAGE = ROOT / "docs" / "flags.md"
GENERATED = re.compile(r"<!-- generated: python -m gpt2.config.cli -->\n```text\n(.*?)```\n<!-- end generated -->",
                       re.S)


def test_flags_page_is_the_generated_help() -> None:
    """docs/flags.md's list is `python -m gpt2.config.cli` (train.py --help at a fixed width): regenerate it when a
    flag, default or help changes."""
    found = GENERATED.search(FLAGS_PAGE.read_text())
    assert found, "docs/flags.md lost its generated block"
    assert found.group(1) == flags_page(), "docs/flags.md is stale: paste `python -m gpt2.config.cli` into it"


def test_every_cli_flag_is_documented() -> None:
    """Beyond the generated list, the page says what each flag does in detail."""
    notes = GENERATED.sub("", FLAGS_PAGE.read_text())
    flags = {opt for action in build_parser()._actions for opt in action.option_strings
             if opt.startswith("--") and opt not in ("--help", "--local_rank", "--local-rank")}
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", notes))
    assert not missing, f"docs/flags.md does not describe: {missing}"


def test_readme_is_short_and_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path = target.split("#")[0]
            assert not path or (page.parent / path).exists(), f"{page.name} links to a missing {target}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
