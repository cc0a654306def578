"""Write the microbenchmark store (benchmarks/results/store/microbench.csv) from the committed raw files.

    python -m tools.microbench_import            # rewrite the store from the raw files below
    python -m tools.microbench_import --check    # exit 1 when the committed store differs from the raw files'

Every row is one number read from the raw file its `raw` column names; nothing is typed by hand here but what the
raw file does not carry (the call's name or commit where a README beside the file states them, the device where
the file's header names it). SOURCES lists the files; a new benchmark run adds its file there.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tools.results_store import MICROBENCH, MICROBENCH_COLUMNS, ROOT, append_rows, read_rows
from tools.results_tables import by_id, configuration

R = "benchmarks/results/"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
Row = dict[str, Any]
RUNS = by_id(read_rows())

KERNEL_IMPLS = {"eager": "eager", "torch.compile": "inductor", "triton": "ours-triton", "cuda": "ours-cuda",
                "liger": "liger", "liger-fp32acc": "liger-fp32acc"}
GEMM_IMPLS = {"cublas": "cublas", "triton": "ours-triton", "naive": "ours-cuda-naive", "smem": "ours-cuda-smem",
              "regblock": "ours-cuda-regblock", "wmma": "ours-cuda-wmma", "mma_128x128": "ours-cuda-mma128x128",
              "mma_128x256": "ours-cuda-mma128x256", "wgmma": "ours-cuda-wgmma",
              "wgmma_persistent": "ours-cuda-wgmma-persistent"}
EPILOGUE_IMPLS = {"cublas + add + gelu (eager)": "eager", "cublas addmm (bias) + gelu": "cublas-addmm+gelu",
                  "cublas + triton bias_gelu": "cublas+ours-triton", "cublasLt fused (_addmm_activation)": "cublaslt",
                  "wgmma_persistent_bias_gelu": "ours-cuda-wgmma-persistent"}


def csv_rows(raw: str) -> list[dict[str, str]]:
    with (ROOT / raw).open(newline="") as f:
        return list(csv.DictReader(f))


def day(stamp: str) -> str:
    return stamp[:10]


def size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def kernels(raw: str, benchmark: str, call: str, commit: str = "") -> Iterator[Row]:
    """benchmarks.kernels' CSV: device ms per kernel and pass, GB/s or TFLOP/s, fwd+bwd peak memory."""
    for r in csv_rows(raw):
        base = {"date": day(r["date"]), "commit": commit, "call": call, "device": r["device"],
                "benchmark": benchmark, "op": f"{r['kernel']} {r['pass']}",
                "implementation": KERNEL_IMPLS[r["impl"]], "shape": r["shape"].replace("gpt2-large-train ", ""),
                "raw": raw}
        for column, metric in (("ms", "ms"), ("GB/s", "GB/s"), ("TFLOP/s", "TFLOP/s"), ("peak_mem_MiB", "MiB")):
            if r.get(column):  # a CSV of one kernel has only the columns it measured
                yield {**base, "metric": metric, "value": r[column]}


def lm_head_chunks(raw: str, call: str, commit: str) -> Iterator[Row]:
    """benchmarks.lm_head_chunks: the LM head + cross-entropy fwd+bwd per token count, our Triton op by chunk size
    (`ours-triton 2^k`) against Inductor's head and eager, device ms and peak MiB."""
    for r in csv_rows(raw):
        impl = r["impl"].replace("triton ", "ours-triton ")
        base = {"date": day(r["date"]), "commit": commit, "call": call, "device": r["device"],
                "benchmark": "lm-head-chunks", "op": "lm_head + cross_entropy fwd+bwd",
                "implementation": KERNEL_IMPLS.get(impl, impl), "shape": f"[{r['tokens']}, 1280]", "raw": raw}
        for column, metric in (("ms", "ms"), ("peak_mem_MiB", "MiB")):
            yield {**base, "metric": metric, "value": r[column]}


def kernels_copy(raw: str, benchmark: str, call: str) -> Iterator[Row]:
    """The copy bandwidth benchmarks.kernels measured in the same process (its Markdown's header)."""
    text = (ROOT / raw).read_text()
    head = re.search(r"\(([^,]+) x1, (\S+), ", text)
    copy = re.search(r"device-to-device copy (\d+) GB/s", text)
    assert head and copy, raw
    yield {"date": day(head[2]), "call": call, "device": head[1], "benchmark": benchmark,
           "op": "device-to-device copy", "implementation": "torch", "shape": "", "metric": "GB/s",
           "value": copy[1], "raw": raw}


def attention(raw: str, call: str) -> Iterator[Row]:
    for r in csv_rows(raw):
        if r["error"]:
            continue  # the flash-attn package was not installed: no number
        base = {"date": day(r["date"]), "call": call, "device": r["device"], "benchmark": "attention",
                "implementation": f"sdpa-{r['backend']}", "shape": f"[{r['B']}, {r['H']}, {r['T']}, {r['hd']}]",
                "raw": raw}
        for column, op, metric in (("fwd_ms", "attention fwd", "ms"), ("fwdbwd_ms", "attention fwd+bwd", "ms"),
                                   ("fwdbwd_peak_MiB", "attention fwd+bwd", "MiB"),
                                   ("err_grad", "attention fwd+bwd", "max_abs_err_grad")):
            yield {**base, "op": op, "metric": metric, "value": r[column]}


def gemm(raw: str, call: str, commit: str = "") -> Iterator[Row]:
    """benchmarks.gemm.bench's ladder: TFLOP/s (its gflops / 1000) per kernel and shape; skipped cells left out."""
    for r in csv_rows(raw):
        if r["status"] != "PASS":
            continue
        yield {"date": day(r["date"]), "commit": commit, "call": call, "device": r["device"], "benchmark": "gemm",
               "op": r["shape"], "implementation": GEMM_IMPLS[r["kernel"]],
               "shape": f"{r['M']}x{r['N']}x{r['K']}", "metric": "TFLOP/s", "value": float(r["gflops"]) / 1000,
               "raw": raw, "note": "TFLOP/s = the raw file's gflops / 1000"}


def bias_gelu(raw: str, call: str, commit: str = "") -> Iterator[Row]:
    for r in csv_rows(raw):
        yield {"date": day(r["date"]), "commit": commit, "call": call, "device": r["device"],
               "benchmark": "gemm-epilogue", "op": "mlp_up + bias + GELU fwd",
               "implementation": EPILOGUE_IMPLS[r["variant"]], "shape": f"{r['M']}x{r['N']}x{r['K']}",
               "metric": "ms", "value": r["time_ms"], "raw": raw}


def mlp_fwd_bwd(raw: str, call: str, commit: str = "") -> Iterator[Row]:
    """The up-projection's bias+GELU forward (keeping the pre-activation) and the down-projection's dgrad with
    GELU's backward and the bias gradient, eager's ops against our fused epilogues."""
    impls = {"bf16 sum": "eager", "fp32 sum": "eager-fp32-sum", "fused": "ours-cuda-wgmma-persistent"}
    for r in csv_rows(raw):
        impl = next(v for k, v in impls.items() if k in r["variant"])
        for column, op in (("fwd_ms", "fwd"), ("bwd_ms", "bwd"), ("total_ms", "fwd+bwd")):
            yield {"date": day(r["date"]), "commit": commit, "call": call, "device": r["device"],
                   "benchmark": "gemm-mlp", "op": f"MLP bias+GELU epilogues {op}", "implementation": impl,
                   "shape": f"{r['tokens']}x{r['d_ff']}x{r['d']}", "metric": "ms", "value": r[column], "raw": raw,
                   "note": r["variant"]}


NCU_METRICS = (("gpu__time_duration.sum", "us"),
               ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM throughput pct"),
               ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "tensor pipe active pct"))


def ncu(raw: str, call: str, commit: str, date: str, device: str) -> Iterator[Row]:
    """One Nsight Compute text report: our kernel's launch, then cuBLAS's, each with its metrics."""
    shape = re.search(r"(\d+x\d+x\d+)\.txt$", raw)[1]
    impl = ""
    for line in (ROOT / raw).read_text().splitlines():
        if re.match(r"\s{2}\S.*Context \d+, Stream", line):
            impl = "ours-cuda-wgmma-persistent" if "wgmma_persistent_kernel" in line else "cublas"
        for metric, name in NCU_METRICS:
            if line.split()[:1] == [metric]:
                yield {"date": date, "commit": commit, "call": call, "device": device, "benchmark": "gemm-ncu",
                       "op": "matmul", "implementation": impl, "shape": shape, "metric": name,
                       "value": line.split()[-1], "raw": raw, "note": "one launch, clocks unlocked"}


def collectives(raw: str, call: str) -> Iterator[Row]:
    """benchmarks.collectives: NCCL's all-reduce and our ring's, time and bus bandwidth per message size."""
    for r in csv_rows(raw):
        if r["op"] not in ("all_reduce", "ring_all_reduce") or r["status"] != "ok":
            continue
        base = {"date": day(r["date"]), "call": call, "device": r["device"], "benchmark": "collectives",
                "op": "all_reduce", "implementation": "ours-ring" if r["op"] == "ring_all_reduce" else "nccl",
                "shape": f"{r['world_size']} ranks, {size(int(r['bytes']))} {r['dtype']}", "raw": raw}
        yield {**base, "metric": "us", "value": r["time_us"]}
        yield {**base, "metric": "busbw GB/s", "value": r["busbw_GBps"]}


def tp_group_comm(raw: str, call: str, date: str, device: str) -> Iterator[Row]:
    """benchmarks.tp_group_comm's Markdown table: NCCL all-reduce per group of the training grid, idle or not."""
    for line in (ROOT / raw).read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 5 or not cells[3].replace(".", "").isdigit():
            continue
        group, ranks, during, us, busbw = cells
        base = {"date": date, "call": call, "device": device, "benchmark": "tp-comm",
                "op": f"all_reduce, {'idle' if during == 'idle' else 'beside GEMMs'}", "implementation": "nccl",
                "shape": f"{group} group ({ranks} ranks), 20 MiB bf16", "raw": raw}
        yield {**base, "metric": "us", "value": us}
        yield {**base, "metric": "busbw GB/s", "value": busbw}


def tp_scaling(raw: str, call: str) -> Iterator[Row]:
    for r in csv_rows(raw):
        overlap = {"True": ", overlap", "False": "", "n/a": ""}[r["overlap"]]
        yield {"date": day(r["date"]), "call": call, "device": r["device"], "benchmark": "tp-scaling",
               "op": f"{r['layer']}, {r['scaling']}{overlap}", "implementation": f"ours-tp{r['tp']}",
               "shape": f"{r['tokens']} tokens, d {r['hidden']}", "metric": "ms", "value": r["ms"], "raw": raw,
               "note": f"ffn {r['ffn_global']} over the ranks"}


def per_op(raw: str, call: str) -> Iterator[Row]:
    """benchmarks.microbench: one GPT-2 Large block's ops, eager, forward and backward device ms."""
    for r in csv_rows(raw):
        if r["group"] == "summary" and "whole block" not in r["op"]:
            continue  # the model estimate is arithmetic, not a measurement
        for column, metric in (("fwd_ms", "fwd ms"), ("bwd_ms", "bwd ms"), ("total_ms", "fwd+bwd ms")):
            if r[column]:
                yield {"date": day(r["date"]), "call": call, "device": r["device"], "benchmark": "per-op",
                       "op": r["op"], "implementation": "eager", "shape": f"batch {r['batch']}, seq {r['seq']}",
                       "metric": metric, "value": r[column], "raw": raw}


def profile(raw: str, run: int) -> Iterator[Row]:
    """A training step's profile breakdown (gpt2/observe/profiling.py): device ms per step by kernel category, of the
    results store's run `run` (its date, call, device and configuration)."""
    data = json.loads((ROOT / raw).read_text())
    r = RUNS[run]
    base = {"date": r["date"], "commit": r["commit"], "call": r["call"], "device": r["device"], "benchmark": "profile",
            "implementation": f"#{run} {configuration(r)}, batch {r['batch']}, {r['gpus']} GPU"
                              + ("s" if r["gpus"] != "1" else ""),
            "shape": "", "metric": "ms per step", "raw": raw}
    for category, ms in data["ms_per_step"].items():
        yield {**base, "op": category, "value": ms}
    yield {**base, "op": "device busy", "value": data["device_busy_ms_per_step"]}
    yield {**base, "op": "step wall", "value": data["step_wall_ms"]}


P = R + "profiles/"
# in store order: a new source goes at the end, so that no row's id changes
SOURCES: tuple[tuple[Callable[..., Iterator[Row]], tuple[Any, ...]], ...] = (
    (kernels_copy, (R + "kernels/kernels.md", "kernels", "10:17Z")),
    (kernels, (R + "kernels/kernels.csv", "kernels", "10:17Z")),
    (kernels, (R + "kernels/h100-2026-11-25/kernels.csv", "liger", "7", "76ed1b0")),
    (attention, (R + "attention/attention_backends.csv", "13:22Z")),
    (gemm, (R + "gemm/gemm.csv", "09:53Z")),
    (gemm, (R + "gemm/h100-2026-11-25/gemm.csv", "13:26Z")),
    (bias_gelu, (R + "gemm/h100-2026-11-25/gemm_bias_gelu.csv", "13:26Z")),
    (bias_gelu, (R + "gemm/h100-2026-11-26/gemm_bias_gelu.csv", "22", "a2b4a2c")),
    (mlp_fwd_bwd, (R + "gemm/h100-2026-11-26/gemm_mlp_fwd_bwd.csv", "22", "a2b4a2c")),
    *((ncu, (f"{R}gemm/h100-2026-11-25/ncu/ncu_wgmma_persistent_{s}.txt", "14", "1361ef7", "2026-11-25", H100))
      for s in ("4096x4096x4096", "8192x1280x5120", "3840x1280x8192", "1280x1280x8192")),
    (collectives, (R + "collectives/collectives_n2.csv", "09:52Z")),
    (collectives, (R + "collectives/h100x4-2026-11-28/collectives_n2.csv", "E")),
    (collectives, (R + "collectives/h100x4-2026-11-28/collectives_n4.csv", "E")),
    (tp_group_comm, (R + "collectives/tp_group_comm_n4.md", "tp_group_comm", "2026-11-22", H200)),
    (tp_scaling, (R + "tp_scaling/h100x4-2026-11-28/tp_scaling.csv", "E")),
    (per_op, (R + "microbench/microbench_gpt2-large.csv", "09:53Z")),
    *((profile, (P + path, run)) for path, run in (
        ("h100-2026-11-25-seq1024/call10A_compiled_single_b32_breakdown.json", 10),
        ("h100x4-2026-11-28/D_fsdp2-tp2-none-b48_compile_breakdown.json", 165),
        ("h100x4-2026-11-28/D_hybrid-tp2-none-b48_compile_breakdown.json", 166),
        ("h100x4-2026-11-28/D_hybrid-tp2-sp-none-b48_compile_breakdown.json", 167),
        ("h200-2026-11-29-x3/zero3-flat-u4-b8_profile_breakdown.json", 138),
        ("h200x2-2026-11-29/C_zero3-flat-u4-b8_profile_breakdown.json", 196),
        ("h200x2-2026-11-29/D_zero3-tp2-flat-u4-b8_profile_breakdown.json", 200))),
    (kernels, (R + "kernels/h200-2026-12-02-c1/kernels.csv", "liger", "h200-2026-12-02-c1", "0e27a99")),
    (kernels, (R + "kernels/e2e-h200-2026-12-02-e2/ce/kernels.csv", "liger", "h200-2026-12-02-e2", "66c634a")),
    (kernels, (R + "kernels/h200-2026-12-02-g5/kernels.csv", "liger", "h200-2026-12-02-g5", "9111245")),
    (lm_head_chunks, (R + "kernels/e2e-h200-2026-12-02-i3/study/lm_head_chunks.csv", "h200-2026-12-02-i3", "5ab5d7d")),
)


def rows() -> list[Row]:
    return [row for read, args in SOURCES for row in read(*args)]


def write(path: Path) -> list[int]:
    path.unlink(missing_ok=True)
    return append_rows(rows(), path, columns=MICROBENCH_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when the committed store differs from the raw files")
    p.add_argument("--store", type=Path, default=MICROBENCH)
    args = p.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / "microbench.csv"
            write(fresh)
            if fresh.read_text() != args.store.read_text():
                print(f"{args.store} differs from its raw files: run python -m tools.microbench_import",
                      file=sys.stderr)
                return 1
        return 0
    print(f"{len(write(args.store))} rows -> {args.store}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
