"""PyTorch SDPA's attention kernels (and the flash-attn package, where installed) at GPT-2 Large's shapes: time,
peak memory and error, and what `--attn sdpa` and `--attn auto` pick there.

    python -m benchmarks.attention_backends --out benchmarks/results/attention        # GPU, < 60 s on an H100
    python -m benchmarks.attention_backends --device cpu --batch-sizes 1 --seq-len 64 --backends math --out /tmp/a

Shapes: causal self-attention, q/k/v [B, H, T, hd] = [8 and 32, 20, 1024, 64] in bf16 (GPT-2 Large's 20 heads of 64
at sequence length 1024, micro-batch 8 and 32; no dropout). Backends: `flash`, `cudnn`, `efficient`, `math` are
`F.scaled_dot_product_attention` restricted to that kernel (`--attn sdpa-<name>`), `flash-attn` the flash-attn
package's `flash_attn_func` (`--attn flash`). A backend that refuses the inputs is a row with its error.

Columns: `fwd_ms` (under no_grad) and `fwdbwd_ms` (forward with grad, then backward of a random output gradient):
the median of --iters calls, CUDA events around each (wall time on CPU); `TFLOP/s` counts causal attention as
2 B H T^2 hd FLOPs forward (half of 4 B H T^2 hd) and 3.5x that for forward + backward (flash-attn's convention:
the backward is 2.5 forwards); `fwd_peak_MiB` / `fwdbwd_peak_MiB`: torch.cuda.max_memory_allocated during one call,
above q, k, v and the output gradient; `err_out` / `err_grad`: max |x - ref| of the output and of dq, dk, dv
against the math kernel in fp32 on the same (bf16-rounded) inputs, over the first min(B, 8) sequences.
Results: attention_backends.csv and attention_backends.md in --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from benchmarks.measure import median_ms, peak_alloc_mib
from fused_kernels.attention import (
    SDPA_BACKENDS,
    AttentionFn,
    AttentionShape,
    first_line,
    fwd_bwd,
    make_flash_attention,
    make_sdpa_backend_attention,
    resolve_attention,
    sdpa_backend_used,
)
from tools.common import device_tag, markdown_table, tag_line, write_csv

BACKENDS = ("flash", "cudnn", "efficient", "math", "flash-attn")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COLUMNS = ["B", "H", "T", "hd", "dtype", "backend", "fwd_ms", "fwdbwd_ms", "fwd_TFLOP/s", "fwdbwd_TFLOP/s",
           "vs_fastest", "fwd_peak_MiB", "fwdbwd_peak_MiB", "err_out", "err_grad", "error"]
ERR_BATCH = 8  # sequences the fp32 reference is computed on


def backend_fn(name: str) -> AttentionFn:
    if name == "flash-attn":
        return make_flash_attention()  # KernelUnavailableError without the package
    return make_sdpa_backend_attention(SDPA_BACKENDS[f"sdpa-{name}"])


def measure(name: str, inputs: list[torch.Tensor], ref: list[torch.Tensor], iters: int) -> dict[str, object]:
    """One backend at one shape: times, peak memories and errors (raises where the backend refuses)."""
    fn = backend_fn(name)
    q, k, v, dout = inputs
    device = q.device
    B, H, T, hd = q.shape
    n = min(B, ERR_BATCH)
    got = fwd_bwd(fn, *(t[:n] for t in inputs), 0.0)  # also the first call: a refusing kernel raises here
    row: dict[str, object] = {
        "err_out": f"{(got[0].float() - ref[0]).abs().max().item():.2e}",
        "err_grad": f"{max((g.float() - r).abs().max().item() for g, r in zip(got[1:], ref[1:], strict=True)):.2e}",
    }
    del got
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd() -> None:
        with torch.no_grad():
            fn(q, k, v, 0.0)

    def fwd_and_bwd() -> None:
        for t in leaves:
            t.grad = None
        fn(*leaves, 0.0).backward(dout)

    flops = 2.0 * B * H * T * T * hd
    for key, step, work in (("fwd", fwd, flops), ("fwdbwd", fwd_and_bwd, 3.5 * flops)):
        ms = median_ms(step, iters, warmup=3, device=device)
        row[f"{key}_ms"] = round(ms, 4)
        row[f"{key}_TFLOP/s"] = round(work / ms / 1e9, 1)
        if device.type == "cuda":
            row[f"{key}_peak_MiB"] = peak_alloc_mib(step)
    return row


def run_shape(B: int, args: argparse.Namespace, device: torch.device) -> tuple[list[dict[str, object]], list[str]]:
    """Every backend at [B, H, T, hd]; and what sdpa and auto pick there (markdown lines)."""
    dtype = DTYPES[args.dtype]
    H, T, hd = args.heads, args.seq_len, args.head_dim
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = [torch.randn(B, H, T, hd, generator=gen).to(device=device, dtype=dtype) for _ in range(4)]
    n = min(B, ERR_BATCH)
    ref = fwd_bwd(make_sdpa_backend_attention(SDPA_BACKENDS["sdpa-math"]), *(t[:n].float() for t in inputs), 0.0)
    rows = []
    for name in args.backends.split(","):
        row: dict[str, object] = {"B": B, "H": H, "T": T, "hd": hd, "dtype": args.dtype, "backend": name}
        try:
            row.update(measure(name, inputs, ref, args.iters))
        except Exception as e:  # the kernel refuses these inputs, flash-attn is missing, out of memory, ...
            row["error"] = first_line(e)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(" | ".join(str(row.get(c, "")) for c in COLUMNS), flush=True)
    timed = [r for r in rows if "fwdbwd_ms" in r]
    if timed:
        best = min(float(r["fwdbwd_ms"]) for r in timed)
        for r in timed:
            r["vs_fastest"] = round(float(r["fwdbwd_ms"]) / best, 2)
    del inputs, ref
    shape = AttentionShape(B, H, T, hd, dtype, device, 0.0)
    note = (f"- [{B}, {H}, {T}, {hd}] {args.dtype}: `--attn sdpa` runs {sdpa_backend_used(shape.dims, dtype, device)} "
            "(PyTorch's own dispatch choice); ")
    try:
        note += f"`--attn {resolve_attention('auto', shape).describe()}`"
    except Exception as e:  # report, do not lose the table
        note += f"`--attn auto` failed: {type(e).__name__}: {e}"
    notes = [note]
    return rows, notes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/attention")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"any of {','.join(BACKENDS)}")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; pass --device cpu (and a small shape)")
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"unknown --backends {sorted(unknown)}; choose from {','.join(BACKENDS)}")

    start = time.perf_counter()
    tag = device_tag(device)
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    out = Path(args.out)
    for B in (int(b) for b in args.batch_sizes.split(",")):
        shape_rows, shape_notes = run_shape(B, args, device)
        rows += shape_rows
        notes += shape_notes
        write_csv(out / "attention_backends.csv", rows, tag)  # after every shape: a timeout keeps what was measured
    header = (f"# Attention kernels at GPT-2 Large's shapes ({tag_line(tag)})\n\n"
              f"Causal, no dropout; flash-attn package {'installed' if has_flash_attn else 'not installed'}. "
              "Columns: see `benchmarks/attention_backends.py`.\n\n")
    text = header + markdown_table(rows, COLUMNS) + "\n\n## What --attn picks\n" + "\n".join(notes) + "\n"
    (out / "attention_backends.md").write_text(text)
    print("\n" + text + f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
