"""Build an offline wheelhouse for air-gapped compute nodes.

    python scripts/build_wheelhouse.py --out .whl --python-version 3.12 \
        --skip-installed target-freeze.txt deepspeed datasets wandb

1. DeepSpeed is published as an sdist: it is built here into a pure-Python wheel
   (DS_BUILD_OPS=0: its CUDA ops are left to JIT-compile on the target), without build isolation.
2. pip resolves the requested packages for the TARGET interpreter and platform
   (`pip install --dry-run --report` with --python-version/--platform, binary wheels only).
3. Every resolved package the target already has (names in --skip-installed, e.g. the target's
   `pip freeze` or one name per line; torch is always skipped) is dropped; the rest is downloaded.

On the target: `pip install --no-index --find-links .whl deepspeed datasets wandb`, or, where
site-packages is read-only, `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any"]
ALWAYS_SKIP = {"torch", "triton", "nvidia-*"}  # the GPU stack comes with the target's PyTorch


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_installed(path: Path | None) -> set[str]:
    if path is None:
        return set()
    names = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(normalise(re.split(r"[=<>@ ;\[]", line, maxsplit=1)[0]))
    return names


def skipped(name: str, installed: set[str]) -> bool:
    return name in installed or name in ALWAYS_SKIP or name.startswith("nvidia-")


def build_deepspeed_wheel(spec: str, out: Path) -> Path:
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), spec],
                   check=True, env=env)
    return next(out.glob("deepspeed-*.whl"))


def resolve(requirements: list[str], python_version: str) -> list[dict]:
    """Packages pip would install for the target (name, version, url), from its install report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "--target", str(Path(tmp) / "t"), "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd + requirements, check=True)
        return [
            {"name": normalise(item["metadata"]["name"]), "version": item["metadata"]["version"],
             "url": item["download_info"]["url"]}
            for item in json.loads(report.read_text())["install"]
        ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("packages", nargs="*", default=["deepspeed", "datasets", "wandb"])
    p.add_argument("--out", type=Path, default=Path(".whl"))
    p.add_argument("--python-version", default="3.12", help="target interpreter, e.g. 3.12")
    p.add_argument("--skip-installed", type=Path, help="target's `pip freeze` (or names, one per line)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    installed = read_installed(args.skip_installed)

    requirements = []
    for spec in args.packages:
        if normalise(re.split(r"[=<>]", spec)[0]) == "deepspeed":
            requirements.append(str(build_deepspeed_wheel(spec, args.out)))
        else:
            requirements.append(spec)
    wanted = [pkg for pkg in resolve(requirements, args.python_version) if not skipped(pkg["name"], installed)]
    for pkg in wanted:
        if pkg["url"].startswith("file:") and Path(pkg["url"].removeprefix("file://")).parent == args.out.resolve():
            continue  # the DeepSpeed wheel built above is already in --out
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", args.python_version, "--implementation", "cp",
                        *sum((["--platform", pl] for pl in PLATFORMS), []), "-d", str(args.out),
                        f"{pkg['name']}=={pkg['version']}"], check=True)
    print(f"{len(wanted)} packages in {args.out}: " + ", ".join(f"{w['name']}=={w['version']}" for w in wanted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
