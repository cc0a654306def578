"""Standalone repro: Inductor computes a wrong training forward for a GPT-2 of width 1280 compiled whole.

A compact GPT-2 (2 blocks, d=1280, 20 heads, tied embedding, bf16 autocast, batch 8 x 1024 random tokens):
the loss and gradients of `torch.compile(model)` against the same weights run eagerly, with Inductor's
defaults and with `loop_ordering_after_fusion` off. Seen on one H100, torch 2.11.0+cu130: defaults give a
step-0 loss of 11.041 against 11.081 and a 26% error in the embedding's gradient; `aot_eager` is exact, and so
is Inductor with `loop_ordering_after_fusion=False` or `inplace_buffers=False`; width 768 or one block is exact.
The harness turns loop re-ordering off for every compile (gpt2/compiling.py).

    python benchmarks/repro/inductor_loop_ordering_inplace.py     # exit 1 while the bug is present
"""

import math
import sys

import torch
import torch._inductor.config
import torch.nn as nn
import torch.nn.functional as F

N_LAYER, N_HEAD, D, VOCAB, PADDED_VOCAB, B, T = 2, 20, 1280, 50257, 50304, 8, 1024


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.c_fc, self.mlp_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(B, T, N_HEAD, D // N_HEAD).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(D, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(PADDED_VOCAB, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(D)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * N_LAYER) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., :VOCAB]  # tied head, padded rows cut
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def loss_and_grad(model: GPT, fn, idx: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fn(idx, targets)
    loss.backward()
    return loss.item(), model.wte.weight.grad.float().clone()


def main() -> int:
    torch.manual_seed(0)
    model = GPT().cuda()
    idx, targets = torch.randint(0, VOCAB, (2, B, T), device="cuda")
    ref_loss, ref_grad = loss_and_grad(model, model, idx, targets)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: eager loss {ref_loss:.5f}")
    bad = False
    for setting in (True, False):
        torch._dynamo.reset()
        torch._inductor.config.loop_ordering_after_fusion = setting
        loss, grad = loss_and_grad(model, torch.compile(model), idx, targets)
        err = ((grad - ref_grad).norm() / ref_grad.norm()).item()
        wrong = abs(loss - ref_loss) > 5e-3 or err > 0.05  # bf16 noise: ~1e-5 in the loss, ~0.5% in the gradient
        bad |= wrong and setting
        print(f"loop_ordering_after_fusion={setting!s:5}: loss {loss:.5f}, wte grad rel err {err:.4f}"
              f" -> {'WRONG' if wrong else 'ok'}")
    print("BUG PRESENT" if bad else "no bug")
    return int(bad)


if __name__ == "__main__":
    sys.exit(main())
