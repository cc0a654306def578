"""The LM head + cross-entropy at GPT-2 Large's training token counts: the Triton op's chunk size against Inductor's
fused head and eager, one fwd+bwd timed alone on the device, with its peak memory.

    python -m benchmarks.lm_head_chunks --out benchmarks/results/lm_head/<call>          # CUDA
    python -m benchmarks.lm_head_chunks --tokens 8192 --chunks 26,28 --no-compile       # a subset

Each row is one implementation at one token count N (rows of hidden [N, 1280] bf16, the tied weight [50304, 1280]
bf16, targets over the real 50257 entries): `eager` (`fused_kernels.reference.lm_cross_entropy`), `torch.compile`
(the same function compiled alone, as Inductor compiles the head inside a whole-model graph) and `triton 2^k` (the
custom op `fused_kernels.triton.cross_entropy.lm_cross_entropy` with chunks of at most 2^k logits, i.e.
2^k // 50304 rows; `triton one-chunk`: all N rows at once). `ms` is device time (`benchmarks.kernels.device_ms`: kernel
durations, L2 flushed), `wall_ms` the median of CUDA events around each call; `peak_mem_MiB` is what one fwd+bwd
allocates above its inputs. `loss_err` and `grad_err` compare with eager (the loss, and the largest difference of
either gradient scaled by that gradient's largest magnitude). Results: lm_head_chunks.csv / .md in --out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.kernels import VOCAB, VOCAB_PADDED, device_ms
from benchmarks.measure import median_ms, peak_alloc_mib, report_table
from fused_kernels import lm_head_chunk_rows, reference
from tools.common import device_tag

D_MODEL = 1280  # GPT-2 Large
COLUMNS = ["tokens", "impl", "chunk_rows", "ms", "wall_ms", "x_compile", "peak_mem_MiB", "loss_err", "grad_err"]
HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def implementations(tokens: int, chunk_exponents: list[int], compile_: bool) -> dict[str, tuple[HeadFn, int | None]]:
    """name -> (fn(hidden, weight, targets) -> (loss, n_correct), the Triton op's rows per chunk or None)."""
    def eager(h, w, t):
        return reference.lm_cross_entropy(h, w, t, VOCAB)

    impls: dict[str, tuple[HeadFn, int | None]] = {"eager": (eager, None)}
    if compile_:
        torch._dynamo.reset()  # one graph per token count: never the recompile limit
        impls["torch.compile"] = (torch.compile(eager, dynamic=False), None)
    from fused_kernels.triton.cross_entropy import lm_cross_entropy

    def triton(rows: int) -> HeadFn:
        return lambda h, w, t: lm_cross_entropy(h, w, t, VOCAB, chunk_rows=rows)

    for k in chunk_exponents:
        rows = lm_head_chunk_rows(tokens, VOCAB_PADDED, 1 << k)
        impls[f"triton 2^{k}"] = (triton(rows), rows)
    impls["triton one-chunk"] = (triton(tokens), tokens)
    return impls


def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, D_MODEL, device="cuda", generator=gen).to(torch.bfloat16)  # [N, d]
    w = (torch.randn(VOCAB_PADDED, D_MODEL, device="cuda", generator=gen) * D_MODEL**-0.5).to(torch.bfloat16)
    t = torch.randint(0, VOCAB, (tokens,), device="cuda", generator=gen)  # [N]
    return h.requires_grad_(), w.requires_grad_(), t


def fwd_bwd(fn: HeadFn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    h.grad = w.grad = None  # as after zero_grad(set_to_none=True)
    loss, _ = fn(h, w, t)
    loss.backward()
    return loss.detach()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def measure(tokens: int, impls: dict[str, tuple[HeadFn, int | None]]) -> list[dict[str, object]]:
    h, w, t = inputs(tokens)
    want_loss = fwd_bwd(impls["eager"][0], h, w, t)
    want_grads = (h.grad.clone(), w.grad.clone())
    rows = []
    for name, (fn, chunk_rows) in impls.items():
        row: dict[str, object] = {"tokens": tokens, "impl": name, "chunk_rows": chunk_rows or ""}
        try:
            loss = fwd_bwd(fn, h, w, t)
            row["loss_err"] = f"{abs(loss.item() - want_loss.item()):.2e}"
            row["grad_err"] = f"{max(_rel_err(h.grad, want_grads[0]), _rel_err(w.grad, want_grads[1])):.2e}"
            row["ms"] = round(device_ms(lambda fn=fn: fwd_bwd(fn, h, w, t)), 3)
            row["wall_ms"] = round(median_ms(lambda fn=fn: fwd_bwd(fn, h, w, t), iters=10, device=h.device), 3)
            row["peak_mem_MiB"] = peak_alloc_mib(lambda fn=fn: fwd_bwd(fn, h, w, t))
        except Exception as e:  # recorded in the row; the next implementation still runs
            row["loss_err"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        rows.append(row)
        torch.cuda.empty_cache()
    compiled = next((r["ms"] for r in rows if r["impl"] == "torch.compile" and "ms" in r), None)
    for row in rows:
        if compiled and "ms" in row:
            row["x_compile"] = round(compiled / row["ms"], 3)  # > 1: faster than Inductor's head
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192,32768,65536", help="token counts (batch x 1024 at batches 8, 32, 64)")
    p.add_argument("--chunks", default="26,27,28,29,30", help="chunk sizes to try, as exponents of 2 (logits)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--out", type=Path, default=None, help="directory for lm_head_chunks.csv / .md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.lm_head_chunks needs a CUDA GPU (it times device kernels)")
    exponents = [int(k) for k in args.chunks.split(",")]
    rows = []
    for tokens in (int(n) for n in args.tokens.split(",")):
        rows += measure(tokens, implementations(tokens, exponents, args.compile))
    report_table("LM head + cross-entropy, fwd+bwd: chunk size vs Inductor", " ".join(sys.argv), rows, COLUMNS,
                 out=args.out, stem="lm_head_chunks", tag=device_tag())


if __name__ == "__main__":
    main()
