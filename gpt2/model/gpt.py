"""GPT-2 in plain PyTorch: one readable, parallel-unaware file.

What is injectable, and why:
- `ops` (a `fused_kernels.KernelOps`): the linear(+GELU), residual-add + LayerNorm and
  LM-head cross-entropy implementations. The default is plain PyTorch; `--fused-kernels`
  swaps in Triton/CUDA without this file importing a backend.
- `attention`: the scaled-dot-product attention function (SDPA by default, flash-attn by flag).
- Modules, not functions, own every parameter, and every parameter is read inside the forward
  of the module that owns it: DeepSpeed ZeRO-3 gathers a module's parameters in that module's
  forward pre-hook, and the tensor-parallel plan (`parallel.tp_plan`) swaps `Linear`,
  `nn.Embedding` and `LMHead` for parallel versions with the same forward signatures.
- Initialisation happens in each module's constructor (GPT-2: N(0, 0.02), residual output
  projections N(0, 0.02/sqrt(2 n_layer)), zero biases), so it also runs under
  `deepspeed.zero.Init`, which partitions each module's parameters right after its constructor.
  The attention block reads its local head count from the QKV width, so a column-parallel
  `c_attn` holding whole heads needs no change here.

    python train.py --mode single --model gpt2-tiny --data synthetic
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fused_kernels import REFERENCE_OPS, KernelOps
from gpt2.config.schema import ModelConfig

INIT_STD = 0.02

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def applies_weight_decay(shape: torch.Size | tuple[int, ...]) -> bool:
    """GPT-2's AdamW recipe, by a parameter's full shape: decay on matrices and embeddings, none on biases and
    LayerNorm gains."""
    return len(shape) >= 2


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention. q, k, v: [B, H, T, hd] -> [B, H, T, hd]."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class Linear(nn.Linear):
    """nn.Linear with GPT-2 init whose matmul (and optional fused GELU) comes from `ops`."""

    def __init__(self, in_features: int, out_features: int, ops: KernelOps, std: float = INIT_STD):
        super().__init__(in_features, out_features, bias=True)
        self.ops = ops
        nn.init.normal_(self.weight, mean=0.0, std=std)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias, gelu)


class LayerNorm(nn.LayerNorm):
    """LayerNorm that can fuse the residual add before it: returns (LN(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float, ops: KernelOps):
        super().__init__(dim, eps=eps)
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_layernorm(x, residual, self.weight, self.bias, self.eps)


class Embedding(nn.Embedding):
    def __init__(self, num: int, dim: int):
        super().__init__(num, dim)
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class LMHead(nn.Module):
    """Tied LM head + loss. Owns a reference to the token-embedding weight (GPT-2 ties them)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, ops: KernelOps):
        super().__init__()
        self.weight = weight  # [V_padded, d], shared with wte
        self.vocab_size = vocab_size
        self.ops = ops

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None):
        if targets is None:
            return F.linear(hidden, self.weight)[..., : self.vocab_size]  # [B, T, V]
        d = hidden.shape[-1]
        return self.ops.lm_cross_entropy(hidden.reshape(-1, d), self.weight, targets.reshape(-1), self.vocab_size)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, attention: AttentionFn):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.attention = attention
        # c_attn output is [q | k | v], each n_embd wide (the layout of HF GPT-2's fused c_attn)
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, ops)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, ops, std=INIT_STD / math.sqrt(2 * cfg.n_layer))
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # [B, T, 3*d_local]; d_local = d / tp under tensor parallelism
        B, T, _ = qkv.shape  # under sequence parallelism x holds T/tp positions and c_attn gathers all T
        d_local = qkv.shape[-1] // 3
        n_heads = d_local // self.head_dim
        q, k, v = (t.view(B, T, n_heads, self.head_dim).transpose(1, 2) for t in qkv.split(d_local, dim=2))
        y = self.attention(q, k, v, self.dropout if self.training else 0.0)  # [B, H, T, hd]
        y = y.transpose(1, 2).reshape(B, T, d_local)  # [B, T, d_local]
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, ops)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, ops, std=INIT_STD / math.sqrt(2 * cfg.n_layer))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.mlp is not None:  # one op across both Linears (the backend fuses GELU's backward into c_proj's)
            return self.dropout(self.ops.mlp(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias))
        h = self.c_fc(x, gelu=True)  # [B, T, 4d]: GELU_tanh(x W^T + b)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, attention: AttentionFn):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_eps, ops)
        self.attn = CausalSelfAttention(cfg, ops, attention)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.ln_1(x)
        a = self.attn(h)
        h, x = self.ln_2(a, residual=x)  # x <- x + a; h = LN(x), in one fused op where available
        return x + self.mlp(h)


class GPT(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ops: KernelOps = REFERENCE_OPS,
        attention: AttentionFn = sdpa_attention,
    ):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = False
        self.wte = Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, ops, attention) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_eps, ops)
        self.lm_head = LMHead(self.wte.weight, cfg.vocab_size, ops)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: [B, T] token ids.

        Returns logits [B, T, vocab_size] without targets, else (mean loss, correct top-1 count).
        """
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)  # [T]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, d]
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        h, _ = self.ln_f(x)
        return self.lm_head(h, targets)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameters counted once (tied weights once). Without embeddings: minus wte and wpe."""
        n = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if not include_embeddings:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n
