"""The one parameter and FLOP formula of GPT-2: what a block holds, what N in 6N is, FLOPs per token (model and
hardware). The meters (`gpt2.observe.metrics`), the summary and the planner all read it from here."""

from __future__ import annotations

from gpt2.config.schema import ModelConfig


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer block: 12 d^2 + 13 d (QKV 3d^2+3d, attn-out d^2+d, MLP up 4d^2+4d, down
    4d^2+d, two LayerNorms 4d)."""
    d = cfg.n_embd
    return 12 * d * d + 13 * d


def model_params_for_flops(cfg: ModelConfig) -> int:
    """N in the FLOPs formula: all blocks + final LayerNorm + the (tied) token embedding, unpadded.

    The tied token embedding is counted once, because it is the LM-head matmul (V x d per token,
    forward and backward). Position embeddings are excluded: a lookup does no matmul FLOPs.
    Vocab padding rows are excluded: they are not part of the model's function.
    """
    return cfg.n_layer * block_params(cfg) + 2 * cfg.n_embd + cfg.vocab_size * cfg.n_embd


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM / nanoGPT convention:

        6 N + 12 L d T

    N from `model_params_for_flops` (matmul weights incl. the tied LM head, 2 FLOPs per
    multiply-add, x3 for forward + backward), and 12 L d T for the attention score and value
    matmuls (QK^T and AV over the full T x T square; causal masking is not discounted).
    """
    return 6.0 * model_params_for_flops(cfg) + 12.0 * cfg.n_layer * cfg.n_embd * seq_len


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int, activation_checkpointing: bool) -> float:
    """FLOPs the hardware executes per token: model FLOPs, plus one more forward of the blocks when checkpointing.

    `GPT.forward` recomputes only the transformer blocks in backward; the embedding lookup, final LayerNorm
    and LM head run once. So the extra work is the blocks' forward alone:

        2 N_blocks + 4 L d T,   N_blocks = L (12 d^2 + 13 d)

    2 N_blocks: 2 FLOPs per multiply-add over the block weights. 4 L d T: the forward half of the 12 L d T
    attention term (QK^T and AV, 2 T d FLOPs each per token and layer; backward is twice that, hence 12).
    This is below the whole-model x 4/3, because the tied LM head (V d in N) is not re-run.
    It counts a full re-run of each block. Eager (uncompiled) blocks run less: non-reentrant checkpoint stops
    once the last saved tensor is rebuilt, skipping the MLP down-projection (CPU FlopCounterMode: 8 d^2, not
    12 d^2, linear FLOPs per layer re-run), so there HFU is an upper bound.
    Under tensor parallelism each rank recomputes its 1/tp share of the same blocks, so dividing this
    per-token total by all GPUs (as MFU does) stays consistent.
    """
    base = flops_per_token(cfg, seq_len)
    if not activation_checkpointing:
        return base
    recompute = 2.0 * cfg.n_layer * block_params(cfg) + 4.0 * cfg.n_layer * cfg.n_embd * seq_len
    return base + recompute


def param_count(cfg: ModelConfig) -> int:
    """All parameters, the tied LM head counted once (equals GPT.num_params())."""
    d = cfg.n_embd
    return cfg.n_layer * block_params(cfg) + cfg.padded_vocab_size * d + cfg.n_positions * d + 2 * d
