"""Analytical model of one GPT-2 training step: bytes communicated and memory per GPU, for a layout.

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

    from gpt2.planning.perf_model import Layout, Workload, step_communication, comm_time, memory_per_gpu
    ops = step_communication(cfg, Workload(batch=128, seq_len=1024), Layout(dp=4, tp=2, zero_stage=3))
    seconds = comm_time(ops, {"dp": 80e9, "tp": 350e9, "pp": 40e9})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from gpt2.config.layout import check_tp_divides_model
from gpt2.config.schema import ModelConfig, check_sequence_parallel

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"]
Group = Literal["dp", "tp", "pp"]

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
class Layout:
    """How the world is split. zero_stage 0 is plain DDP; 3 is ZeRO-3 / FSDP full sharding."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    micro_batches: int = 1  # per optimizer step: gradient-accumulation or pipeline micro-batches
    pipeline_schedule: Literal["gpipe", "1f1b"] = "gpipe"

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp, self.micro_batches) < 1:
            raise ValueError(f"dp, tp, pp and micro_batches must be >= 1: {self}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0..3, got {self.zero_stage}")
        check_sequence_parallel(self.tp, self.sequence_parallel)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Workload:
    batch: int  # sequences per optimizer step, all data-parallel replicas together
    seq_len: int

    def micro_batch(self, layout: Layout) -> int:
        """Sequences in one forward pass of one GPU."""
        per = layout.dp * layout.micro_batches
        if self.batch % per:
            raise ValueError(f"batch {self.batch} is not divisible by dp x micro_batches = {per}")
        return self.batch // per


@dataclass(frozen=True)
class StateBytes:
    """Bytes per element of each kind of state."""

    param_bytes: int = 2  # weights the forward and backward read
    grad_bytes: int = 2
    optimizer_bytes: int = 12  # AdamW: fp32 master weights + exp_avg + exp_avg_sq
    activation_bytes: int = 2


MIXED_PRECISION = StateBytes()  # 16-bit weights and grads, fp32 master + moments: ZeRO's 2 + 2 + 12
AMP_FP32_WEIGHTS = StateBytes(param_bytes=4, grad_bytes=4, optimizer_bytes=8)  # torch.autocast: fp32 weights


def _check_layout(cfg: ModelConfig, layout: Layout) -> None:
    if cfg.n_layer % layout.pp:
        raise ValueError(f"pp {layout.pp} does not divide n_layer {cfg.n_layer}")
    check_tp_divides_model(cfg, layout.tp)


def stage_params(cfg: ModelConfig, layout: Layout, stage: int = 0) -> float:
    """Parameters one GPU of pipeline `stage` holds before ZeRO sharding (one TP shard).

    Under TP the column-parallel QKV and MLP-up weights and biases, the row-parallel weights and
    the vocab-parallel embedding are split; row-parallel biases (2d), LayerNorms (4d), the
    position table and ln_f are replicated: (12d^2 + 7d)/t + 6d per layer. Stage 0 holds the
    embeddings; the last stage holds ln_f and, when pp > 1, a copy of the tied word embedding.
    """
    _check_layout(cfg, layout)
    d, t, pp = cfg.n_embd, layout.tp, layout.pp
    n = cfg.n_layer // pp * ((12 * d * d + 7 * d) / t + 6 * d)
    word_embedding = cfg.padded_vocab_size * d / t
    if stage == 0:
        n += word_embedding + cfg.n_positions * d
    if stage == pp - 1:
        n += 2 * d + (word_embedding if pp > 1 else 0)
    return n


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


def step_communication(
    cfg: ModelConfig,
    work: Workload,
    layout: Layout,
    precision: StateBytes = MIXED_PRECISION,
    stage: int = 0,
) -> list[CommOp]:
    """Collectives one GPU of pipeline `stage` takes part in during one optimizer step.

    DP: DDP all-reduces the gradients once per step (accumulation under no_sync). ZeRO-1
    reduce-scatters gradients once and all-gathers the updated 16-bit weights; ZeRO-2
    reduce-scatters every micro-batch; ZeRO-3/FSDP all-gathers the weights in forward and again
    in backward and reduce-scatters gradients, every micro-batch.
    TP (Megatron): per layer and micro-batch two all-reduces of [b, s, h] in forward (g after the
    attention and MLP output projections) and two in backward (f before QKV and MLP-up), two more
    with activation checkpointing (recomputed forward); one for the vocab-parallel embedding
    (stage 0) and one for the LM-head input's gradient (last stage), plus three fp32 [b, s]
    all-reduces of the vocab-parallel cross-entropy (max, sum-exp, target logit). With sequence
    parallelism each [b, s, h] all-reduce becomes an all-gather + reduce-scatter (same bytes).
    PP: point-to-point activations forward and their gradients backward ([b, s, h], split by t
    under sequence parallelism); bytes sent by this stage, plus the tied embedding's gradient
    all-reduce between the first and last stage.
    """
    _check_layout(cfg, layout)
    ops: list[CommOp] = []
    b, s, d, m = work.micro_batch(layout), work.seq_len, cfg.n_embd, layout.micro_batches
    first, last = stage == 0, stage == layout.pp - 1
    n = stage_params(cfg, layout, stage)

    if layout.dp > 1:
        dp, z = layout.dp, layout.zero_stage
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

    if layout.tp > 1:
        t = layout.tp
        act = b * s * d * precision.activation_bytes
        per_layer = 4 + (2 if layout.activation_checkpointing else 0)
        calls = m * (cfg.n_layer // layout.pp * per_layer + int(first) + int(last))
        if layout.sequence_parallel:
            ops.append(CommOp("activation all-gather (SP)", "tp", "all_gather", t, act, calls))
            ops.append(CommOp("activation reduce-scatter (SP)", "tp", "reduce_scatter", t, act, calls))
        else:
            ops.append(CommOp("activation all-reduce", "tp", "all_reduce", t, act, calls))
        if last:
            ops.append(CommOp("vocab-parallel CE all-reduce", "tp", "all_reduce", t, b * s * FP32_BYTES, 3 * m))

    if layout.pp > 1:
        act = b * s * d * precision.activation_bytes / (layout.tp if layout.sequence_parallel else 1)
        sends = m * (int(not last) + int(not first))  # activations forward, gradients backward
        ops.append(CommOp("stage boundary send", "pp", "send_recv", 2, act, sends))
        if first or last:
            wte = cfg.padded_vocab_size * d / layout.tp * precision.grad_bytes
            ops.append(CommOp("tied embedding grad all-reduce", "pp", "all_reduce", 2, wte, 1))
    return ops


def comm_time(ops: list[CommOp], busbw: float | Mapping[str, float]) -> float:
    """Seconds per step with no overlap. busbw: bytes/s for every group, or per group ("dp", "tp", "pp")."""
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
    """Bytes per GPU (one pipeline stage)."""

    params: float
    grads: float
    optimizer: float
    activations: float  # the blocks' saved tensors (and, with checkpointing, one recomputed block)
    logits: float  # final LayerNorm, logits and cross-entropy buffers (last stage only)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits


def memory_per_gpu(
    cfg: ModelConfig,
    work: Workload,
    layout: Layout,
    precision: StateBytes = MIXED_PRECISION,
    flash: bool = True,
    stage: int | None = None,
) -> MemoryBreakdown:
    """Model states and activations of one GPU of pipeline `stage` (None: the stage with the largest total).

    ZeRO shards optimizer states (stage >= 1), gradients (>= 2) and weights (3) over dp.
    Micro-batches whose activations are alive at once: 1 without pipelining (accumulation runs
    them one after another), all m under GPipe, min(pp - stage, m) under 1F1B.
    With full activation checkpointing every block keeps only its input (e sbh, /t with SP)
    and one block is recomputed at a time during backward. The last stage also holds ln_f's
    input and output (2 e sbh, /t with SP) per live micro-batch, and during the loss the 16-bit
    logits, their fp32 copy and the fp32 log-softmax saved for backward (e + 4 + 4 bytes per
    [b, s, V/t] element), of which the log-softmax stays alive for every live micro-batch.
    """
    if stage is None:
        stages = {0, layout.pp - 1}
        return max((memory_per_gpu(cfg, work, layout, precision, flash, st) for st in stages), key=lambda r: r.total)
    n = stage_params(cfg, layout, stage)
    z, dp, e = layout.zero_stage, layout.dp, precision.activation_bytes
    params = n * precision.param_bytes / (dp if z >= 3 else 1)
    grads = n * precision.grad_bytes / (dp if z >= 2 else 1)
    optimizer = n * precision.optimizer_bytes / (dp if z >= 1 else 1)

    b, s, h = work.micro_batch(layout), work.seq_len, cfg.n_embd
    t, sp = layout.tp, layout.sequence_parallel
    if layout.pp == 1:
        live = 1
    elif layout.pipeline_schedule == "gpipe":
        live = layout.micro_batches
    else:
        live = min(layout.pp - stage, layout.micro_batches)
    layer = layer_activation_bytes(cfg, b, s, t, sp, flash, activation_bytes=e)
    n_layers = cfg.n_layer // layout.pp
    if layout.activation_checkpointing:
        activations = n_layers * live * e * s * b * h / (t if sp else 1) + layer
    else:
        activations = n_layers * live * layer

    logits = 0.0
    if stage == layout.pp - 1:
        tokens = b * s
        logits = live * 2 * e * tokens * h / (t if sp else 1)
        logits += tokens * cfg.padded_vocab_size / t * (e + FP32_BYTES + FP32_BYTES * live)
    return MemoryBreakdown(params, grads, optimizer, activations, logits)
