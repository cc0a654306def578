"""Per-op time breakdown of one GPT-2 block (forward and backward), plus the LM head and loss.

    python -m benchmarks.microbench --model gpt2-large --batch-size 8 --seq-len 1024 --dtype bf16
    python -m benchmarks.microbench --detailed --export-csv benchmarks/results/microbench.csv

Each op runs the real modules of gpt2/model/gpt.py (with the reference ops, as training runs them by
default) on inputs of the shape it sees inside the block, under the same autocast. Forward time:
median over iterations of the op alone; backward time: median of `autograd.grad` of its output
with respect to its inputs and parameters. A self-check first verifies that the chain of ops
reproduces `Block.forward`, so the table measures what we train. Shares are of the sum of the
ops (the whole block, timed as one, is printed next to it). `--detailed` adds a torch.profiler
kernel table and a Chrome trace of whole-block forward+backward. Runs on CPU too (slowly).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.measure import median_ms
from fused_kernels import REFERENCE_OPS
from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.model.gpt import Block, Embedding, LayerNorm, LMHead, sdpa_attention
from tools.common import device_tag, markdown_table, tag_line, write_csv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Op:
    name: str
    group: str  # "attention", "mlp", "block" (the rest of the block), "head"
    fn: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    params: tuple[torch.nn.Parameter, ...]
    flops: float = 0.0  # forward matmul/attention FLOPs (backward counted as 2x)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def build_ops(block: Block, head: tuple[LayerNorm, LMHead], x: torch.Tensor, targets: torch.Tensor,
              amp: contextlib.AbstractContextManager) -> list[Op]:
    """The block as a chain of ops; each op's inputs are the (detached) outputs of the previous one."""
    B, T, d = x.shape
    attn, mlp = block.attn, block.mlp
    hd = attn.head_dim

    def attention(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in qkv.split(d, dim=2))  # [B, H, T, hd]
        y = attn.attention(q, k, v, attn.dropout if block.training else 0.0)  # [B, H, T, hd]
        return y.transpose(1, 2).reshape(B, T, d)  # [B, T, d]

    ln_f, lm_head = head
    with amp, torch.no_grad():
        h1 = block.ln_1(x)[0]
        qkv = attn.c_attn(h1)
        y = attention(qkv)
        a = attn.c_proj(y)
        a_drop = attn.resid_dropout(a)
        h2, x2 = block.ln_2(a_drop, residual=x)
        u = mlp.c_fc(h2)
        g = F.gelu(u, approximate="tanh")
        m = mlp.c_proj(g)
        m_drop = mlp.dropout(m)
    tok = B * T
    lin = 2 * tok * d * d  # FLOPs of a d x d projection
    return [
        Op("ln_1", "attention", lambda t: block.ln_1(t)[0], (_leaf(x),), tuple(block.ln_1.parameters())),
        Op("qkv_proj", "attention", attn.c_attn, (_leaf(h1),), tuple(attn.c_attn.parameters()), 3 * lin),
        Op("attention (sdpa)", "attention", attention, (_leaf(qkv),), (), 2 * B * T * T * d),  # causal: half of 4BT^2d
        Op("attn_out_proj", "attention", attn.c_proj, (_leaf(y),), tuple(attn.c_proj.parameters()), lin),
        Op("attn_dropout", "attention", attn.resid_dropout, (_leaf(a),), ()),
        Op("ln_2 + residual add", "block", lambda t, r: block.ln_2(t, residual=r)[0], (_leaf(a_drop), _leaf(x)),
           tuple(block.ln_2.parameters())),
        Op("mlp_up_proj", "mlp", mlp.c_fc, (_leaf(h2),), tuple(mlp.c_fc.parameters()), 4 * lin),
        Op("gelu", "mlp", lambda t: F.gelu(t, approximate="tanh"), (_leaf(u),), ()),
        Op("mlp_down_proj", "mlp", mlp.c_proj, (_leaf(g),), tuple(mlp.c_proj.parameters()), 4 * lin),
        Op("mlp_dropout", "mlp", mlp.dropout, (_leaf(m),), ()),
        Op("residual add", "block", torch.add, (_leaf(x2), _leaf(m_drop)), ()),
        Op("ln_f + lm_head + loss", "head", lambda t: lm_head(ln_f(t)[0], targets)[0], (_leaf(x),),
           (*ln_f.parameters(), lm_head.weight), 2 * tok * d * lm_head.weight.shape[0]),
    ]


def verify_decomposition(block: Block, x: torch.Tensor, amp: contextlib.AbstractContextManager) -> None:
    """The op chain reproduces Block.forward (eval mode: dropout off), so the table measures the real block."""
    was_training = block.training
    block.eval()
    B, T, d = x.shape
    with amp, torch.no_grad():
        ref = block(x)
        h1 = block.ln_1(x)[0]
        q, k, v = (t.view(B, T, -1, block.attn.head_dim).transpose(1, 2) for t in block.attn.c_attn(h1).split(d, 2))
        a = block.attn.c_proj(block.attn.attention(q, k, v, 0.0).transpose(1, 2).reshape(B, T, d))
        h2, x2 = block.ln_2(a, residual=x)
        out = x2 + block.mlp.c_proj(F.gelu(block.mlp.c_fc(h2), approximate="tanh"))
    block.train(was_training)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


def time_op(op: Op, iters: int, device: torch.device, amp: contextlib.AbstractContextManager) -> tuple[float, float]:
    """(forward ms, backward ms), medians."""
    def fwd() -> torch.Tensor:
        with amp:
            return op.fn(*op.inputs)

    fwd_ms = median_ms(fwd, iters, warmup=3, device=device)
    out = fwd()
    grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
    wrt = [t for t in (*op.inputs, *op.params) if t.requires_grad]
    bwd_ms = median_ms(lambda: torch.autograd.grad(out, wrt, grad, retain_graph=True), iters, warmup=3, device=device)
    return fwd_ms, bwd_ms


def profile(block: Block, x: torch.Tensor, iters: int, device: torch.device, amp: contextlib.AbstractContextManager,
            out_dir: Path) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        for _ in range(iters):
            with amp:
                y = block(x)
            y.backward(torch.ones_like(y))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out_dir / "microbench_trace.json"))
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25)
    (out_dir / "microbench_kernels.txt").write_text(table)
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="gpt2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="autocast dtype on GPU; CPU runs fp32")
    p.add_argument("--dropout", type=float, default=0.1, help="GPT-2's 0.1, so the dropout rows mean something")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--detailed", action="store_true", help="torch.profiler kernel table and Chrome trace")
    p.add_argument("--export-csv", type=Path, help="write the per-op rows here")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")),
                   help="folder of the trace and kernel table (--detailed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
    amp = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    preset = MODEL_PRESETS[args.model]
    cfg = ModelConfig(**{**preset, "n_positions": max(preset.get("n_positions", 1024), args.seq_len)},
                      dropout=args.dropout)
    torch.manual_seed(0)
    block = Block(cfg, REFERENCE_OPS, sdpa_attention).to(device).train()
    wte = Embedding(cfg.padded_vocab_size, cfg.n_embd).to(device)
    head = (LayerNorm(cfg.n_embd, cfg.layer_norm_eps, REFERENCE_OPS).to(device),
            LMHead(wte.weight, cfg.vocab_size, REFERENCE_OPS))
    x = torch.randn(args.batch_size, args.seq_len, cfg.n_embd, device=device)
    targets = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), device=device)

    verify_decomposition(block, x, amp)
    ops = build_ops(block, head, x, targets, amp)
    rows: list[dict[str, object]] = []
    for op in ops:
        fwd, bwd = time_op(op, args.iters, device, amp)
        row: dict[str, object] = {"op": op.name, "group": op.group, "fwd_ms": round(fwd, 4), "bwd_ms": round(bwd, 4),
                                  "total_ms": round(fwd + bwd, 4)}
        if op.flops:
            row["tflops"] = float(f"{3 * op.flops / ((fwd + bwd) / 1e3) / 1e12:.3g}")  # fwd + 2x bwd
        rows.append(row)
    block_ops = [r for r in rows if r["group"] != "head"]
    total = sum(r["total_ms"] for r in block_ops)
    fwd_total = sum(r["fwd_ms"] for r in block_ops)
    mlp_fwd = sum(r["fwd_ms"] for r in rows if r["group"] == "mlp")
    for r in block_ops:
        r["share_of_block_%"] = round(100 * r["total_ms"] / total, 1)
        r["fwd_share_of_block_%"] = round(100 * r["fwd_ms"] / fwd_total, 1)
        if r["group"] == "mlp":
            r["fwd_share_of_mlp_%"] = round(100 * r["fwd_ms"] / mlp_fwd, 1)

    def whole_block() -> None:
        with amp:
            y = block(x)
        y.backward(torch.ones_like(y))

    block_ms = median_ms(whole_block, args.iters, warmup=3, device=device)
    head_ms = next(r["total_ms"] for r in rows if r["group"] == "head")
    rows.append({"op": "whole block (fwd+bwd, timed as one)", "group": "summary", "total_ms": round(block_ms, 4)})
    rows.append({"op": f"model estimate: {cfg.n_layer} blocks + head", "group": "summary",
                 "total_ms": round(cfg.n_layer * block_ms + head_ms, 3)})

    tag = device_tag(device)
    print(f"# {args.model}, batch {args.batch_size}, seq {args.seq_len}, {dtype}, dropout {args.dropout}: "
          f"{tag_line(tag)}\n")
    print(markdown_table(rows, ["op", "fwd_ms", "bwd_ms", "total_ms", "share_of_block_%", "fwd_share_of_block_%",
                                "fwd_share_of_mlp_%", "tflops"]))
    print(f"\nsum of block ops {total:.3f} ms vs whole block {block_ms:.3f} ms (the difference: launch gaps, "
          "autograd bookkeeping, caching-allocator reuse)")
    if args.detailed:
        print("\n" + profile(block, x, min(args.iters, 5), device, amp, args.out))
        print(f"Chrome trace: {args.out / 'microbench_trace.json'}")
    if args.export_csv:
        meta = {"model": args.model, "batch": str(args.batch_size), "seq": str(args.seq_len), "dtype": str(dtype)}
        print("wrote", write_csv(args.export_csv, rows, {**meta, **tag}))
    return rows


if __name__ == "__main__":
    main()
