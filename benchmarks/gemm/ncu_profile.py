"""Profile one GEMM kernel and cuBLAS at one shape with Nsight Compute (ncu), to see what limits the kernel.

    python -m benchmarks.gemm.ncu_profile [--kernel wgmma_persistent] [--shape 4096,4096,4096] [--out DIR]

Runs itself under `ncu` (its --run mode launches the kernel once, then torch.matmul once, on fresh inputs)
and profiles the matching launches: the SpeedOfLight, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis,
WarpStateStats and Occupancy sections, plus the duration, SM / DRAM throughput, bf16 tensor-op count and,
where this ncu knows them on GH100, the tensor-pipe utilisation metrics (`ncu --query-metrics`). Clocks are not
locked (--clock-control none), so durations compare with the benchmark's. Needs the extension built (it is
built if not: run after benchmarks.gemm.bench to reuse its build) and a Hopper GPU for the wgmma kernels.
Look at: SM throughput / tensor pipe % (near 100%: compute bound, as it should be), DRAM throughput (should be
far from peak at these intensities), and the warp stall reasons of the consumer warps (long scoreboard /
barrier: waiting for TMA data or the epilogue's named barriers).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

KERNEL_REGEX = {"wgmma_persistent": "wgmma_persistent_kernel", "wgmma": "wgmma_kernel",
                "mma_128x128": "mma_kernel", "mma_128x256": "mma_kernel"}
CUBLAS_REGEX = "nvjet|gemm|xmma|cutlass"  # cuBLAS's Hopper kernels (none of ours match)
BASE_METRICS = ["gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed"]
OPTIONAL = re.compile(r"^(sm__pipe_tensor_op_(gmma|hmma)_cycles_active|sm__ops_path_tensor_src_bf16_dst_fp32|"
                      r"sm__inst_executed_pipe_tensor_op_gmma)\b")
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats", "Occupancy"]


def optional_metrics(ncu: str) -> list[str]:
    """The tensor-pipe metrics this ncu has for GH100 (H100/H200), with the suffixes worth printing."""
    try:
        out = subprocess.run([ncu, "--query-metrics", "--chip", "gh100"], capture_output=True, text=True,
                             timeout=60).stdout
    except (subprocess.TimeoutExpired, OSError):
        return []
    names = sorted({m.group(0) for line in out.splitlines() if (m := OPTIONAL.match(line.strip()))})
    return [f"{n}.sum" if n.startswith("sm__ops") or n.startswith("sm__inst") else
            f"{n}.avg.pct_of_peak_sustained_active" for n in names]


def run_once(kernel: str, M: int, N: int, K: int) -> None:
    import torch

    from benchmarks.gemm.bench import build_extension

    fn = build_extension(kernels=[kernel])[kernel]
    g = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    B = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
    C = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    fn(A, B, C)
    torch.matmul(A, B, out=C)
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", default="wgmma_persistent", choices=sorted(KERNEL_REGEX))
    p.add_argument("--shape", default="4096,4096,4096", help="M,N,K")
    p.add_argument("--out", help="also write the ncu report (.ncu-rep) and the text output here")
    p.add_argument("--run", action="store_true", help=argparse.SUPPRESS)  # the profiled process
    args = p.parse_args(argv)
    M, N, K = (int(x) for x in args.shape.split(","))
    if args.run:
        run_once(args.kernel, M, N, K)
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("ncu not found")
    # build (or load) the extension outside ncu, so the profiled process only loads it
    subprocess.run([sys.executable, "-c", "from benchmarks.gemm.bench import build_extension; "
                    f"build_extension(kernels=['{args.kernel}'])"], check=True, cwd=Path(__file__).parents[2])
    metrics = BASE_METRICS + optional_metrics(ncu)
    cmd = [ncu, "--clock-control", "none", "-k", f"regex:{KERNEL_REGEX[args.kernel]}|{CUBLAS_REGEX}",
           "--launch-count", "4", *[a for s in SECTIONS for a in ("--section", s)], "--metrics", ",".join(metrics)]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        cmd += ["-f", "-o", str(Path(args.out) / f"ncu_{args.kernel}_{M}x{N}x{K}")]
    cmd += [sys.executable, "-m", "benchmarks.gemm.ncu_profile", "--run", "--kernel", args.kernel,
            "--shape", args.shape]
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[2])
    text = r.stdout + r.stderr
    if args.out:  # with -o ncu writes the report, not the text: print it from the report
        rep = Path(args.out) / f"ncu_{args.kernel}_{M}x{N}x{K}.ncu-rep"
        if rep.exists():
            text += subprocess.run([ncu, "--import", str(rep)], capture_output=True, text=True).stdout
        (Path(args.out) / f"ncu_{args.kernel}_{M}x{N}x{K}.txt").write_text(text)
    print(text)
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
