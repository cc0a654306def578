"""Analytical model of one GPT-2 training step: bytes communicated and memory per GPU, for a run's `RunLayout`.

Communication uses the ring cost model of nccl-tests: a collective on a message of `size` bytes
moves `size x factor` bytes through each rank's link (all-reduce 2(n-1)/n, all-gather and
reduce-scatter (n-1)/n, all-to-all (n-1)/n, broadcast and point-to-point 1), so its time at a
measured bus bandwidth is `size x factor / busbw`. `size` is the nccl-tests size: the full
buffer (all-gather output, reduce-scatter input). Times are summed with no overlap, an upper bound.

Memory follows ZeRO (Rajbhandari et al. 2020: 2 + 2 + 12 bytes per parameter under mixed
precision with AdamW) and, for activations, Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Sec. 4): per layer s*b*h*(34 + 5*a*s/h) bytes with
16-bit activations and dropout, split by tensor parallelism as s*b*h*(10 + 24/t + 5*a*s/(h*t)),
or all of it divided by t with sequence parallelism. With SDPA/flash attention the a*s^2*b
score, softmax and dropout tensors are never stored; only the fp32 log-sum-exp (4*a*s*b bytes)
is, so the default here replaces 5*a*s^2*b by 4*a*s*b. Without dropout the two 1-byte masks
(2*s*b*h) disappear. Symbols: s sequence, b micro-batch, h width, a heads, t TP size, V vocab.

The split (dp, tp, ZeRO stage, sequence parallelism, activation checkpointing) and the workload (micro-batch,
accumulation, sequence length) are the layout's: a plan reads the same object a launch does. The harness has no
pipeline parallelism, so neither has this model.

    from gpt2.planning.perf_model import step_communication, comm_time, memory_per_gpu
    ops = step_communication(layout)  # layout = RunLayout.resolve(cfg, world_size, "cuda")
    seconds = comm_time(ops, {"dp": 80e9, "tp": 350e9})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from gpt2.config.layout import RunLayout
    from gpt2.config.schema import ModelConfig

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"]
Group = Literal["dp", "tp"]

LSE_BYTES = 4  # flash/SDPA keeps one fp32 log-sum-exp per (head, token)
MASK_BYTES = 1  # dropout masks are stored as bytes
FP32_BYTES = 4


def bus_factor(collective: Collective, n: int) -> float:
    """nccl-tests' busbw / algbw: bytes through each rank's link per byte of message, on n ranks."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "send_recv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per element of each kind of state."""

    param_bytes: int = 2  # weights the forward and backward read
    grad_bytes: int = 2
    optimizer_bytes: int = 12  # AdamW: fp32 master weights + exp_avg + exp_avg_sq
    activation_bytes: int = 2


MIXED_PRECISION = StateBytes()  # 16-bit weights and grads, fp32 master + moments: ZeRO's 2 + 2 + 12
AMP_FP32_WEIGHTS = StateBytes(param_bytes=4, grad_bytes=4, optimizer_bytes=8)  # torch.autocast: fp32 weights


def zero_stage_of(layout: RunLayout) -> int:
    """The ZeRO stage as this model counts it: 0 for DDP and single (the layout's None); 3 for FSDP2 at either
    --zero-stage (it shards weights, gradients and optimizer states; its 2 only keeps a unit gathered from forward to
    backward, which the planner's `fsdp2_memory` and `fsdp2_communication` model)."""
    return 3 if layout.fsdp2 else layout.zero_stage or 0


def local_block_params(layout: RunLayout) -> float:
    """One transformer block's parameters on one GPU (one TP shard): the column-parallel QKV and MLP-up weights and
    biases and the row-parallel weights are split, the row-parallel biases (2d) and LayerNorms (4d) replicated."""
    d, t = layout.cfg.model.n_embd, layout.tp_size
    return (12 * d * d + 7 * d) / t + 6 * d


def local_root_params(layout: RunLayout) -> float:
    """The parameters outside the blocks on one GPU (one TP shard): the vocab-parallel token embedding, tied to the
    LM head (split), the position table and ln_f (replicated): V d / t + P d + 2d."""
    cfg, t = layout.cfg.model, layout.tp_size
    d = cfg.n_embd
    return cfg.padded_vocab_size * d / t + cfg.n_positions * d + 2 * d


def local_params(layout: RunLayout) -> float:
    """Parameters one GPU holds before ZeRO sharding (one TP shard): `local_block_params` per layer +
    `local_root_params` (whole numbers, so the sum is exact in any order)."""
    return layout.cfg.model.n_layer * local_block_params(layout) + local_root_params(layout)


@dataclass(frozen=True)
class CommOp:
    name: str
    group: Group
    collective: Collective
    group_size: int
    message_bytes: float  # per call, nccl-tests size
    calls: int  # per optimizer step

    @property
    def wire_bytes(self) -> float:
        """Bytes through one GPU's link per optimizer step (ring model)."""
        return self.message_bytes * bus_factor(self.collective, self.group_size) * self.calls

    def time(self, busbw: float) -> float:
        """Seconds per optimizer step at bus bandwidth `busbw` (bytes/s)."""
        return self.wire_bytes / busbw


def step_communication(layout: RunLayout, precision: StateBytes = MIXED_PRECISION) -> list[CommOp]:
    """Collectives one GPU takes part in during one optimizer step.

    DP: DDP all-reduces the gradients once per step (accumulation under no_sync). ZeRO-1
    reduce-scatters gradients once and all-gathers the updated 16-bit weights; ZeRO-2
    reduce-scatters every micro-batch; ZeRO-3/FSDP all-gathers the weights in forward and again
    in backward and reduce-scatters gradients, every micro-batch.
    TP (Megatron): per layer and micro-batch two all-reduces of [b, s, h] in forward (g after the
    attention and MLP output projections) and two in backward (f before QKV and MLP-up), two more
    with activation checkpointing (recomputed forward); one for the vocab-parallel embedding
    and one for the LM-head input's gradient, plus three fp32 [b, s]
    all-reduces of the vocab-parallel cross-entropy (max, sum-exp, target logit). With sequence
    parallelism each [b, s, h] all-reduce becomes an all-gather + reduce-scatter (same bytes).
    """
    cfg, t_cfg = layout.cfg.model, layout.cfg.train
    ops: list[CommOp] = []
    b, s, d, m = t_cfg.batch_size, t_cfg.seq_len, cfg.n_embd, layout.grad_accum
    n = local_params(layout)

    if layout.dp_size > 1:
        dp, z = layout.dp_size, zero_stage_of(layout)
        grads, weights = n * precision.grad_bytes, n * precision.param_bytes
        if z == 0:
            ops.append(CommOp("grad all-reduce", "dp", "all_reduce", dp, grads, 1))
        else:
            ops.append(CommOp("grad reduce-scatter", "dp", "reduce_scatter", dp, grads, 1 if z == 1 else m))
            if z == 3:
                ops.append(CommOp("param all-gather (fwd)", "dp", "all_gather", dp, weights, m))
                ops.append(CommOp("param all-gather (bwd)", "dp", "all_gather", dp, weights, m))
            else:
                ops.append(CommOp("updated param all-gather", "dp", "all_gather", dp, weights, 1))

    if layout.tp_size > 1:
        t = layout.tp_size
        act = b * s * d * precision.activation_bytes
        per_layer = 4 + (2 if t_cfg.activation_checkpointing else 0)
        calls = m * (cfg.n_layer * per_layer + 2)  # + the embedding's and the LM-head input's
        if layout.sequence_parallel:
            ops.append(CommOp("activation all-gather (SP)", "tp", "all_gather", t, act, calls))
            ops.append(CommOp("activation reduce-scatter (SP)", "tp", "reduce_scatter", t, act, calls))
        else:
            ops.append(CommOp("activation all-reduce", "tp", "all_reduce", t, act, calls))
        ops.append(CommOp("vocab-parallel CE all-reduce", "tp", "all_reduce", t, b * s * FP32_BYTES, 3 * m))
    return ops


def comm_time(ops: list[CommOp], busbw: float | Mapping[str, float]) -> float:
    """Seconds per step with no overlap. busbw: bytes/s for every group, or per group ("dp", "tp")."""
    return sum(op.time(busbw if isinstance(busbw, int | float) else busbw[op.group]) for op in ops)


def layer_activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    flash: bool = True,
    dropout: bool | None = None,
    activation_bytes: int = 2,
    residual_bytes: int | None = None,
) -> float:
    """Bytes one block keeps for backward (Korthikanti et al. 2022, Sec. 4.1).

    Replicated across TP ranks (split only by SP): the inputs and outputs of both LayerNorms
    (4 e sbh) and the two dropout masks (2 sbh). Split by TP: Q, K, V (3 e sbh), the attention
    output (e sbh), the MLP up output and GELU output (8 e sbh). Attention: flash/SDPA keeps the
    fp32 log-sum-exp (4 a s b); the unfused path keeps softmax output (e a s^2 b) and, with
    dropout, its mask and output (a s^2 b (1 + e)). e = activation_bytes; e = 2 with dropout
    and no flash gives the paper's sbh (34 + 5 a s / h). `residual_bytes` (default e) is the element
    size of the residual stream, i.e. of the two LayerNorm inputs: 4 under torch.autocast, where the
    embeddings and residual adds stay fp32 and only the LayerNorm outputs are cast for the matmuls.
    """
    s, b, h, a, e = seq_len, micro_batch, cfg.n_embd, cfg.n_head, activation_bytes
    r = e if residual_bytes is None else residual_bytes
    dropout = cfg.dropout > 0 if dropout is None else dropout
    sbh = s * b * h
    replicated = 2 * (r + e) * sbh + (2 * MASK_BYTES * sbh if dropout else 0)
    split = 12 * e * sbh
    if flash:
        split += LSE_BYTES * a * s * b
    else:
        split += a * s * s * b * (e + ((MASK_BYTES + e) if dropout else 0))
    return (replicated + split) / tp if sequence_parallel else replicated + split / tp


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU."""

    params: float
    grads: float
    optimizer: float
    activations: float  # the blocks' saved tensors (and, with checkpointing, one recomputed block)
    logits: float  # final LayerNorm, logits and cross-entropy buffers

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits


def memory_per_gpu(layout: RunLayout, precision: StateBytes = MIXED_PRECISION, flash: bool = True) -> MemoryBreakdown:
    """Model states and activations of one GPU.

    ZeRO shards optimizer states (stage >= 1), gradients (>= 2) and weights (3) over dp.
    Gradient accumulation runs its micro-batches one after another: one micro-batch's activations are alive.
    With full activation checkpointing every block keeps only its input (e sbh, /t with SP)
    and one block is recomputed at a time during backward. ln_f's input and output (2 e sbh, /t with SP),
    and during the loss the 16-bit logits, their fp32 copy and the fp32 log-softmax saved for backward
    (e + 4 + 4 bytes per [b, s, V/t] element).
    """
    cfg, t_cfg = layout.cfg.model, layout.cfg.train
    n = local_params(layout)
    z, dp, e = zero_stage_of(layout), layout.dp_size, precision.activation_bytes
    params = n * precision.param_bytes / (dp if z >= 3 else 1)
    grads = n * precision.grad_bytes / (dp if z >= 2 else 1)
    optimizer = n * precision.optimizer_bytes / (dp if z >= 1 else 1)

    b, s, h = t_cfg.batch_size, t_cfg.seq_len, cfg.n_embd
    t, sp = layout.tp_size, layout.sequence_parallel
    layer = layer_activation_bytes(cfg, b, s, t, sp, flash, activation_bytes=e)
    if t_cfg.activation_checkpointing:
        activations = cfg.n_layer * e * s * b * h / (t if sp else 1) + layer
    else:
        activations = cfg.n_layer * layer
    tokens = b * s
    logits = 2 * e * tokens * h / (t if sp else 1)
    logits += tokens * cfg.padded_vocab_size / t * (e + FP32_BYTES + FP32_BYTES)
    return MemoryBreakdown(params, grads, optimizer, activations, logits)
