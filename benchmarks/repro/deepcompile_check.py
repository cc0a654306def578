"""GPU check of `--compile --compiler deepcompile` (ZeRO-3 under DeepSpeed's DeepCompile) at world size 1.

Does DeepSpeed's DeepCompile op build here, and does train.py's ZeRO-3 DeepCompile path train single's function?
Three steps, each printed as it goes:
1. the environment DeepCompile needs (torch >= 2.6, the cuda accelerator, nvcc/CUDA_HOME and ninja for the JIT
   build of DeepSpeed's `dc` op) and the build itself (`DeepCompileBuilder().load()`; cached under
   ~/.cache/torch_extensions for the train.py run after it);
2. train.py as users launch it, the reference `python train.py --mode single` (started alongside the build) and
   `torchrun --nproc_per_node=1 train.py --mode hybrid --compile --compiler deepcompile` (same seed, data, batch
   and steps; with --zero3, also eager ZeRO-3 for context);
3. per-step loss and pre-clip gradient norm of each run against single's, with a quick verdict: |Δloss| <= 0.02 and
   |Δgrad norm| / norm <= 5% on every step (the bf16 bounds of tests/test_gpu_compile_parity.py for ZeRO-3
   --compile). The table's verdict comes from `python -m benchmarks.parity` (rows zero3-deepcompile[-wN]).

Tokens/s are printed from each run's summary (steps after --throughput-warmup-steps; DeepCompile compiles at step 1
and re-compiles with its prefetch and selective-gather passes after 5 steps, so keep --steps > warm-up > 6); they
come from short runs sharing the GPU with nothing else only when --sequential is given. Not a measurement.

    python benchmarks/repro/deepcompile_check.py --out /tmp/dc                     # gpt2, 16 steps (~3 min)
    python benchmarks/repro/deepcompile_check.py --out /tmp/dc --model gpt2-large --steps 20 --sequential --zero3

Exit status: 0 all runs match single, 1 a run does not match or failed, 3 the DeepCompile op does not build here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOSS_TOL = 0.02
GRAD_NORM_REL_TOL = 0.05


def environment() -> bool:
    """Print what DeepCompile needs; True if it can be tried here."""
    import deepspeed
    import torch
    import torch.utils.cpp_extension
    from deepspeed.accelerator import get_accelerator
    from deepspeed.compile.util import is_deepcompile_supported

    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__} | deepspeed {deepspeed.__version__} | "
          f"GPU {torch.cuda.get_device_name() if cuda else 'none'} | accelerator {get_accelerator().device_name()}")
    cuda_home = torch.utils.cpp_extension.CUDA_HOME
    print(f"CUDA_HOME {cuda_home} | nvcc {shutil.which('nvcc')} | ninja {shutil.which('ninja')} | "
          f"MAX_JOBS {os.environ.get('MAX_JOBS')}")
    print(f"is_deepcompile_supported() = {is_deepcompile_supported()} (torch >= 2.6 and the cuda accelerator)")
    return cuda and is_deepcompile_supported()


def build_op() -> bool:
    from deepspeed.ops.op_builder.dc import DeepCompileBuilder

    start = time.time()
    try:
        DeepCompileBuilder().load()
    except Exception as err:  # noqa: BLE001 -- the build's own message is the report
        print(f"DeepCompile op: BUILD FAILED after {time.time() - start:.0f}s: {type(err).__name__}: "
              f"{str(err)[-3000:]}")
        return False
    print(f"DeepCompile op: built/loaded in {time.time() - start:.0f}s")
    return True


def train_cmd(args: argparse.Namespace, name: str, flags: list[str], torchrun: bool) -> list[str]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"] if torchrun
                else [sys.executable])
    return [*launcher, str(ROOT / "train.py"), *flags, "--model", args.model, "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--log-interval", "1",
            "--warmup-steps", str(max(1, args.steps // 2)), "--throughput-warmup-steps", str(args.throughput_warmup),
            "--eval-batches", "2", "--data", "synthetic", "--precision", "bf16", "--seed", "1337",
            "--wandb", "disabled", "--out-dir", str(args.out / "runs"), "--run-name", name, *args.extra.split()]


def launch(args: argparse.Namespace, name: str, flags: list[str], torchrun: bool) -> subprocess.Popen:
    cmd = train_cmd(args, name, flags, torchrun)
    print("$", " ".join(cmd), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"{name}.log").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def finish(args: argparse.Namespace, name: str, proc: subprocess.Popen) -> dict | None:
    """The run's per-step records and summary, or None (its log's last lines printed) if it failed."""
    try:
        rc = proc.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    run_dir = args.out / "runs" / name
    if rc != 0 or not (run_dir / "summary.json").is_file():
        lines = (args.out / f"{name}.log").read_text(errors="replace").splitlines()
        errors = [line for line in lines if "Error" in line or "error:" in line][-8:]
        print(f"--- {name}: FAILED (exit {rc}); its error lines, then the last lines of {args.out / name}.log:\n"
              + "\n".join([*errors, "...", *lines[-30:]]))
        return None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "grad_norm" in r and "loss" in r]
    launch_log = (args.out / f"{name}.log").read_text(errors="replace")  # DeepSpeed's own log lines are here
    dc_lines = [line for line in launch_log.splitlines()
                if any(k in line for k in ("DeepCompile", "Compiling mode=", "Falling back", "recompile"))
                and "DeepSpeed config:" not in line]
    return {"steps": steps, "summary": json.loads((run_dir / "summary.json").read_text()), "dc_lines": dc_lines}


def compare(name: str, run: dict, ref: dict) -> bool:
    pairs = list(zip(ref["steps"], run["steps"]))
    if len(pairs) != len(ref["steps"]) or not pairs:
        print(f"{name}: {len(run['steps'])} logged steps, single has {len(ref['steps'])}: FAIL")
        return False
    ok = True
    print(f"{name} vs single: step | loss single / run / Δ | grad norm single / run / rel Δ | step s single / run")
    worst_loss = worst_norm = 0.0
    for a, b in pairs:
        dloss = abs(a["loss"] - b["loss"])
        dnorm = abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-12)
        finite = math.isfinite(b["loss"]) and math.isfinite(b["grad_norm"])
        ok &= finite and dloss <= LOSS_TOL and dnorm <= GRAD_NORM_REL_TOL
        worst_loss, worst_norm = max(worst_loss, dloss), max(worst_norm, dnorm)
        print(f"  {a.get('step', '?'):>4} | {a['loss']:.4f} / {b['loss']:.4f} / {dloss:.4f} | "
              f"{a['grad_norm']:.4f} / {b['grad_norm']:.4f} / {100 * dnorm:.2f}% | "
              f"{a.get('step_time_s', float('nan')):.2f} / {b.get('step_time_s', float('nan')):.2f}")
    s, r = run["summary"], ref["summary"]
    print(f"{name}: max |Δloss| {worst_loss:.4f} (<= {LOSS_TOL}), max rel Δgrad norm {100 * worst_norm:.2f}% "
          f"(<= {100 * GRAD_NORM_REL_TOL:.0f}%), val loss {s.get('val_loss')} vs {r.get('val_loss')} -> "
          f"{'MATCHES single' if ok else 'DOES NOT MATCH single'}")
    return ok


def throughput(name: str, run: dict) -> None:
    s = run["summary"]
    tok = s.get("tokens_per_s")
    print(f"{name}: {tok:,.0f} tok/s (short run, not a measurement) | peak alloc "
          f"{s.get('mem/peak_allocated_gib', float('nan')):.2f} GiB | compile={s.get('compile')}"
          if tok else f"{name}: no tokens/s in its summary")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="run folders (OUT/runs) and launch logs")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--throughput-warmup", type=int, default=8)
    p.add_argument("--zero3", action="store_true", help="also eager ZeRO-3 (the same ZeRO-3 settings, no compile)")
    p.add_argument("--sequential", action="store_true",
                   help="one run at a time (default: single runs alongside the op build and the other runs)")
    p.add_argument("--extra", default="", help="train.py flags for every run, e.g. '--activation-checkpointing'")
    p.add_argument("--run-timeout", type=float, default=540.0)
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))  # parallel c++ jobs of the JIT build
    tag = f"{args.model}-{int(time.time())}"

    runs: dict[str, tuple[list[str], bool]] = {"single": (["--mode", "single"], False)}
    if args.zero3:
        runs["zero3"] = (["--mode", "hybrid"], True)
    runs["zero3-deepcompile"] = (["--mode", "hybrid", "--compile", "--compiler", "deepcompile"], True)

    procs: dict[str, subprocess.Popen] = {}
    if not args.sequential:
        procs["single"] = launch(args, f"single-{tag}", *runs["single"])
    if not environment() or not build_op():
        print("DeepCompile cannot run here (see above)")
        for proc in procs.values():
            proc.kill()
        return 3
    results: dict[str, dict | None] = {}
    for name, (flags, torchrun) in runs.items():
        if name in procs:
            continue
        proc = launch(args, f"{name}-{tag}", flags, torchrun)
        if args.sequential:
            results[name] = finish(args, f"{name}-{tag}", proc)
        else:
            procs[name] = proc
    for name, proc in procs.items():
        results[name] = finish(args, f"{name}-{tag}", proc)

    ref = results.get("single")
    ok = ref is not None
    for name, run in results.items():
        if run is None or name == "single":
            ok &= run is not None
            continue
        print("\n".join(f"  [{name} log] {line[:300]}" for line in run["dc_lines"][:12]))
        ok &= ref is not None and compare(name, run, ref)
    for name, run in results.items():
        if run is not None:
            throughput(name, run)
    print("DEEPCOMPILE CHECK: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
