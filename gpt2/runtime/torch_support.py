"""The torch releases the harness supports, and the start-up check that refuses any other.

The range is stated once, as the torch requirement in pyproject.toml. Compiled code paths are version-sensitive:
on torch 2.11, tensor parallelism under --compile trained another function until `parallel.comm` worked around a
Dynamo bug that 2.13 does not have, so a torch outside the tested range may train the wrong function without a
word. CI tests both ends of the range (scripts/test.sh on the newest, scripts/test_torch_floor.sh on the oldest).
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from gpt2.config.schema import ConfigError

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
DISTRIBUTION = "gpt2-hybrid-parallel"
ALLOW_ENV = "GPT2_ALLOW_UNSUPPORTED_TORCH"  # =1: warn instead of refusing (e.g. to try a nightly)


def supported_torch() -> SpecifierSet:
    """The torch specifier of pyproject.toml in a source checkout (how the harness runs), else of the installed
    distribution's metadata (a wheel install has no pyproject.toml beside it)."""
    if PYPROJECT.is_file():
        # the dependencies list's torch entry; a regex, since tomllib needs Python 3.11 and we support 3.10
        found = re.search(r'^\s*"(torch[^"]*)"', PYPROJECT.read_text(), re.M)
        if found is None:
            raise RuntimeError(f"{PYPROJECT} names no torch requirement")
        return Requirement(found.group(1)).specifier
    requirements = [Requirement(line) for line in metadata.requires(DISTRIBUTION) or []]
    return next(r.specifier for r in requirements if r.name == "torch")


def check_torch_version(version: str) -> str | None:
    """Raise ConfigError unless torch `version` is in the supported range; with GPT2_ALLOW_UNSUPPORTED_TORCH=1
    return the warning to log instead. None when supported. A local build tag (`2.11.0+cu130`) does not count."""
    supported = supported_torch()
    # pre-releases inside the range count: NVIDIA's containers ship builds such as 2.12.0a0+<commit>
    if supported.contains(Version(version), prereleases=True):
        return None
    problem = (f"torch {version} is outside the supported range {supported} (pyproject.toml), in which every mode was "
               f"checked to train the same function as --mode single")
    if os.environ.get(ALLOW_ENV) == "1":
        return f"{problem}; running anyway because {ALLOW_ENV}=1"
    raise ConfigError(f"{problem}; install a supported torch (pip install 'torch{supported}', or run "
                      f"scripts/setup.sh in a fresh environment), or set {ALLOW_ENV}=1 to run at your own risk")
