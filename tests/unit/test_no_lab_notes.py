"""Library code says why, never when, where or how fast: no comment, docstring or string of gpt2/, parallel/,
fused_kernels/ or train.py names a date, a GPU, a measurement (milliseconds, tokens/s, a ratio, "measured ...") or a
file under benchmarks/results/. The numbers behind a default live in docs/decisions.md, which points at the raw
files; a line in the code would go stale unseen when the next run moves them. The one exception is the code that
needs a device name: the peak-FLOPs table (gpt2/observe/metrics.py) and the parser of the names it is keyed by.

Read from the source (comments, docstrings and string literals of .py files; every line of the CUDA/C++ sources), so
it imports nothing and runs in milliseconds.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("gpt2", "parallel", "fused_kernels")
NATIVE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
# file -> top-level definitions whose lines (and the comment block right above them) may name devices
ALLOWED = {"gpt2/observe/metrics.py": {"PEAK_BF16_TFLOPS", "device_product"}}

LAB_NOTE = re.compile("|".join([
    r"\b20\d\d-[01]\d\b",                                  # a date
    r"(?:GH|[ABHV])[1-9]00",                               # a GPU (H100, 4xH200, A100, ...)
    r"benchmarks/results",                                 # a results file
    r"(?i:\bmeasured (?:on|at|in|faster|slower|fastest|no|[\d.]+)\b|\b(?:was|it|where) measured\b)",  # "measured on"
    r"\d[\d,.]*\s?-?ms\b",                                 # 7 ms, 142-ms, 1.02 ms
    r"\d[\d,.]*k?\s?(?:tok|tokens)/s",                     # 83,028 tok/s, 138.7k tokens/s
    r"\b\d+(?:\.\d+)?[x×](?!\w)",                          # 0.98x, 2.4×, 2x
    r"[+-]\d+(?:\.\d+)?%",                                 # +21%
]))


def library_files(root: Path = ROOT) -> list[Path]:
    files = [root / "train.py"]
    for pkg in LIBRARY:
        files += sorted(p for p in (root / pkg).rglob("*") if p.suffix in (".py", *NATIVE_SUFFIXES))
    return files


def allowed_lines(source: str, names: set[str]) -> set[int]:
    """The lines of the top-level definitions `names`, with the comment block directly above each."""
    lines = source.splitlines()
    allowed: set[int] = set()
    for node in ast.parse(source).body:
        targets = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
        if getattr(node, "name", None) in names or set(targets) & names:
            start = node.lineno
            while start > 1 and lines[start - 2].lstrip().startswith("#"):
                start -= 1
            allowed.update(range(start, node.end_lineno + 1))
    return allowed


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of a Python source: where a lab note would be written.
    Code (`measured_steps`, a log format's `tok/s {rate}`) is not prose."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            found += [(tok.start[0] + i, text) for i, text in enumerate(tok.string.splitlines())]
    return found


def lab_notes(path: Path, root: Path = ROOT) -> list[str]:
    """'<path>:<line>: <text>' for each line of `path` that reads like a lab note."""
    rel = path.relative_to(root).as_posix()
    source = path.read_text()
    if path.suffix == ".py":
        skip = allowed_lines(source, ALLOWED.get(rel, set()))
        texts = [(n, t) for n, t in prose(source) if n not in skip]
    else:
        texts = list(enumerate(source.splitlines(), 1))
    return [f"{rel}:{n}: {t.strip()}" for n, t in texts if LAB_NOTE.search(t)]


@pytest.mark.parametrize("text", [
    "on one H200, 2026-11-23", "4xH100", "(benchmarks/results/multi_gpu)", "it measured faster", "Measured on 4 GPUs",
    "where it was measured", "about 7 ms of a 142-ms step", "138.7k tok/s", "0.98x DDP", "2.4-3.0× per block",
    "+21% tokens/s",
])
def test_the_patterns_catch_lab_notes(text: str) -> None:
    assert LAB_NOTE.search(text)


@pytest.mark.parametrize("text", [
    "dp_size x micro_batch x grad_accum x seq_len", "measured_steps", "sm_90a", "6N + 12 L d T", "1e5 threshold",
    "the 2 ranks", "tokens/s", "a ratio of two rows", "the measured ZeRO bytes", "none were measured",
    "Predicted next to measured, for the summary", "TP bytes not measured: predicted only",
])
def test_the_patterns_leave_reasons_alone(text: str) -> None:
    assert not LAB_NOTE.search(text)


def test_the_peak_table_may_name_devices(tmp_path: Path) -> None:
    source = "# H100: datasheet\nPEAK = {'H100': 989.0}\n\n\ndef f():\n    '''on an H100'''\n"
    assert allowed_lines(source, {"PEAK"}) == {1, 2}


def test_library_code_holds_no_lab_notes() -> None:
    found = [note for path in library_files() for note in lab_notes(path)]
    assert not found, ("library code names a date, a device, a measurement or a results file; move the evidence to "
                       "docs/decisions.md and keep the reason here:\n" + "\n".join(found))
