"""Print run folders' summaries side by side as a Markdown table (the reference design's columns).

    python benchmarks/summarize_runs.py runs/ddp-b8 runs/zero3-b8 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = [
    ("run", lambda s: s["run"]),
    ("mode", lambda s: s["mode"] + (f" tp{s['tp_size']}" if s["tp_size"] > 1 else "")),
    ("batch/GPU", lambda s: s["batch_size_per_gpu"]),
    ("GPUs", lambda s: s["world_size"]),
    ("tokens/s", lambda s: f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "n/a"),
    ("MFU", lambda s: f"{100 * s['mfu']:.1f}%" if s["mfu"] else "n/a"),
    ("step (s)", lambda s: f"{s['step_time_s']:.3f}" if s["step_time_s"] else "n/a"),
    ("peak alloc (GiB)", lambda s: f"{s['mem/peak_allocated_gib']:.1f}"),
    ("peak reserved (GiB)", lambda s: f"{s['mem/peak_reserved_gib']:.1f}"),
    ("final loss", lambda s: f"{s['final_loss']:.3f}" if s["final_loss"] is not None else "n/a"),
]


def load(run_dir: Path) -> dict | None:
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    return {"run": run_dir.name, **json.loads(path.read_text())}


def main(paths: list[str]) -> int:
    rows = [s for s in (load(Path(p)) for p in paths) if s]
    if not rows:
        print("no run folder with a summary.json")
        return 1
    print("| " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for s in rows:
        print("| " + " | ".join(str(fn(s)) for _, fn in COLUMNS) + " |")
    first = rows[0]
    print(f"\ndevice: {first['device']}; torch {first['torch_version']}; FLOPs/token {first['flops_per_token']:.4g}; "
          f"peak {first['peak_tflops_per_gpu']} TFLOP/s per GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
