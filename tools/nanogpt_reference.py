"""The calibration floor of the performance issues: a compact nanoGPT-style GPT-2 under DDP + torch.compile.

    torchrun --nproc_per_node=4 -m tools.nanogpt_reference --model gpt2-large --batch-size 16

Deliberately minimal, as a user would write it from nanoGPT (Karpathy): pre-LN blocks with fused QKV, SDPA
causal attention, tanh GELU, tied embeddings, vocabulary padded to 50304, bf16 autocast over fp32 weights,
fused AdamW, `torch.compile(model)` before DDP. Synthetic tokens. It prints tokens/s (all ranks) and MFU with
the same FLOPs/token formula and peak table as train.py (gpt2.observe.metrics), timed over the steps after the warm-up
with a CUDA synchronise at both ends, so its numbers sit next to train.py's of the same shape and machine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.model.flops import flops_per_token
from gpt2.observe.metrics import device_peak_tflops
from tools import results_store


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)  # 3 x [B, T, d]
        q, k, v = (t.view(B, T, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))  # [B, h, T, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class CompactGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(lambda m: nn.init.normal_(m.weight, std=0.02) if isinstance(m, (nn.Linear, nn.Embedding)) else None)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # [B, T, d]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [B, T, Vp]
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-large", choices=list(MODEL_PRESETS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (compilation included)")
    results_store.add_store_arguments(p)
    args = p.parse_args()
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    cfg = ModelConfig(**MODEL_PRESETS[args.model])
    torch.manual_seed(0)
    model = torch.compile(CompactGPT(cfg).to(device))
    model = DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    for step in range(args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    tokens_per_s = (args.steps - args.warmup) * args.batch_size * args.seq_len * dist.get_world_size() / (
        time.perf_counter() - start)
    peak_flops = dist.get_world_size() * device_peak_tflops(device) * 1e12
    mfu = tokens_per_s * flops_per_token(cfg, args.seq_len) / peak_flops
    if rank == 0:
        print(f"nanogpt-reference {args.model} batch {args.batch_size} x {args.seq_len} on {dist.get_world_size()} "
              f"GPUs: {tokens_per_s:,.0f} tok/s, MFU {mfu:.1%}, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} "
              f"GiB, loss {loss.item():.4f}")
        if args.store:
            results_store.append_rows([results_store.row_from_summary(
                {"mode": "baseline", "engine": "nanogpt", "model": args.model, "world_size": dist.get_world_size(),
                 "batch_size_per_gpu": args.batch_size, "seq_len": args.seq_len, "compile": "model",
                 "device": torch.cuda.get_device_name(device), "tokens_per_s": tokens_per_s, "mfu": mfu,
                 "mem/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30},
                call=args.call, raw="(console output)", kind="reference")], args.store)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
