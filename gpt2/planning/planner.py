"""Memory and communication planner: what one GPU holds and sends per step for a run's layout, and
which layouts fit a cluster, ranked by predicted step time. Built on `gpt2.planning.perf_model`.

    python train.py --plan --model gpt2-large --mode hybrid --batch-size 8 --seq-len 1024 --gpus 4
    python train.py --plan --search --gpus 64 --n-layer 32 --n-embd 4096 --n-head 32 --global-batch-size 512

Peak allocated memory per GPU is the larger of two moments. Backward start (the loss's backward runs
while every block's saved tensors are alive): model states + saved activations + loss buffers + weight
copies + workspace. Optimizer step: model states + the gradients that exist only for the step (the fp32 copy
DeepSpeed's 16-bit model makes; FSDP2's sharded gradients, which its reduce-scatters create in backward; single's,
which its backward creates).
The terms, and why (GPT-2 Large, seq 1024, on four GPUs, is the calibration case in tests/unit/test_planner.py; the
runs behind each term: docs/decisions.md):

- States (ZeRO paper): torch.autocast runs (single, DDP) keep fp32 weights (4 B), fp32 gradients (4 B,
  DDP's buckets are the .grad views; single's exist only from its backward to the step's zero_grad, so they count
  at the step: `gradients_made_in_backward`) and AdamW's two fp32 moments (8 B) per parameter; so does DeepSpeed's
  torch_autocast (--zero-precision autocast, the default), sharded by ZeRO stage, its Linear weights and
  gradients communicated in 16 bits. DeepSpeed's own bf16/fp16 (--zero-precision deepspeed) keeps 16-bit
  weights (2 B) and gradients (2 B) and an fp32 master copy + moments (12 B), sharded by ZeRO stage; at the
  step it makes an fp32 copy of its gradient partition (4 B / dp). The calibration runs below used the latter;
  the autocast recipe's ZeRO terms were checked since against GPU runs (tests/unit/test_planner.py).
- Saved activations per block (perf_model.layer_activation_bytes, Korthikanti et al. 2022, flash/SDPA):
  under autocast the residual stream is fp32, so both LayerNorm inputs cost 4 B per element and their
  16-bit casts 2 B: 36 B per token per unit width (+ the fp32 log-sum-exp). Compiled blocks (inductor's
  min-cut partitioner) keep one of the fp32 tensors in 16 bits: 34 B (saved-tensor hooks around an autocast
  GPT-2 Large block on CPU).
  DeepSpeed's 16-bit model has a 16-bit residual stream: 32 B; compiled (ZeRO-3 with per-block compile), 24 B:
  the GELU output [b, s, 4h/t] is not saved but recomputed from the up-projection's output. That was read off
  GPU memory (the slope of peak memory over batch size), not seen in a CPU saved-tensor count, where inductor's
  CPU partitioner keeps it (32 B either way).
- Weight copies: autocast's 16-bit copy of every weight is saved for backward by its matmul (2 B per
  parameter; also under torch.compile in the same CPU measurement, and in a whole-model graph, where Inductor's
  saved tensors include every matrix's 16-bit copy, the tied embedding's too); with activation checkpointing only
  one block's copies and the tied embedding's are alive. ZeRO-3 keeps gathered 16-bit weights alive from
  their forward to their backward when DeepSpeed's trace says they are reused within
  `stage3_max_reuse_distance` parameters (gpt2/config/ds_configs/zero3.json: 1e9, i.e. most of GPT-2 Large's later
  blocks and the tied embedding); this is simulated on the module order (--zero3-fetch module). With our blocks
  as DeepSpeed's leaf modules it keeps every gathered weight to backward at any reuse distance (its comms log
  shows no backward re-gathers; GPU memory agrees). On one data-parallel rank nothing is gathered: a
  parameter's data is its partition.
- Loss (the "logits" term), per token with Vp the padded vocabulary: eager cross-entropy keeps the fp32
  log-softmax and, during its backward, the fp32 nll and log-softmax gradients: 12 B x V. Compiled
  (--compile): inductor saves the 16-bit logits and, in a whole-model graph, writes one 16-bit gradient:
  2 x 2 B x Vp; the head's own graph (per-part scopes) writes the gradient into the saved buffer:
  2 B x Vp. Vocab-parallel (TP): fp32 softmax saved + its fp32 clone as the gradient + the cast to the logits
  dtype: 10 B x Vp / tp.
  Triton fused CE, wherever it runs (`fused_kernels.fused_head_runs`; DeepCompile uses Inductor's own loss): one
  chunk of logits (`fused_kernels.lm_head_chunk_rows`), the fp32 grad_W accumulator and fp32 grad_h; in a
  whole-model graph also one [tokens, Vp] in the activation dtype that no term names: single's measured peaks held
  about that much more at every batch, in the forward (docs/decisions.md; DDP's graph is planned alike, unmeasured).
  Plus ln_f's input and output.
- Workspace: two cuBLAS workspaces (32 MiB each: the forward's thread and autograd's backward thread each have a
  handle), DeepSpeed's reduce bucket (ZeRO-3: one per communication dtype, 16-bit and fp32 under torch_autocast)
  and (ZeRO-3) prefetch bucket.
- Units of several blocks compiled as one graph (DeepSpeed's leaf units, --zero3-unit-blocks N; FSDP2's units,
  --fsdp2-unit-blocks N): every block but a unit's first keeps its residual-stream tensor in fp32, 2 B more per
  token and width than the compiled block above. Measured (DeepSpeed: unit sizes 1, 2 and 4 at two batches, with
  and without TP; FSDP2: the same step, 0.54 GiB higher once its 4-block units became one graph instead of four),
  the tensor not yet named.
- FSDP2 (`fsdp2_memory`), read off one step's phases (benchmarks.memory_phases, GPT-2 Large, batch 8 and 16,
  --compile): no gradient exists between steps or when backward starts (each unit's reduce-scatter creates
  its shard; zero_grad frees them), so the sharded gradients count at the optimizer step only; held when backward
  starts are the root unit (never resharded) and the last block unit (gathered again for backward), not the
  unsharded gradients of any unit yet (with --grad-accum > 1: every unit's, kept unsharded across micro-steps).
  With the blocks gathered in bf16 (--fsdp2-gather), a block's gathered weights are what its matmuls save, so
  the blocks have no autocast copies, and the last block unit is held in 2 B; the root keeps fp32 and its copy.
- Not modelled: the build. Under TP and DeepSpeed ZeRO-3's default `--zero3-fetch flat` every rank builds the whole
  fp32 model (and an `--init-from` state dict) before DeepSpeed partitions it, 4 B per parameter for a moment before
  step 1: GPT-2 XL's 6.2 GB, under any of its training peaks; a model too large for that needs `--zero3-fetch block`
  without TP (built under zero.Init).

Communication bytes per step come from perf_model.step_communication (ring model), plus the collectives
our TP implementation adds (top-1 all-reduce, SP gradient and position-embedding collectives, the
recomputed all-gathers of the overlapped backward), so the TP payload can be compared with CommStats.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from fused_kernels import fused_head_runs, lm_head_chunk_rows
from gpt2.config.cli import resolve_compile_scope
from gpt2.config.deepspeed_file import zero3_defaults
from gpt2.config.layout import (
    RunLayout,
    check_tp_divides_world,
    inductor_compiles_head,
    sequence_splits,
    torch_compiles_whole_model,
    tp_divides_model,
)
from gpt2.config.schema import MODEL_PRESETS, ConfigError, RunConfig
from gpt2.model.flops import hardware_flops_per_token
from gpt2.observe.run_logging import run_label
from gpt2.planning.perf_model import (
    AMP_FP32_WEIGHTS,
    FP32_BYTES,
    MIXED_PRECISION,
    CommOp,
    StateBytes,
    layer_activation_bytes,
    local_block_params,
    local_params,
    local_root_params,
    memory_per_gpu,
    step_communication,
    zero_stage_of,
)
from gpt2.runtime.distributed import env_int
from parallel.dims import dp_size_of, tp_divides_world

GIB = 1024**3
CUBLAS_WORKSPACE_BYTES = 32 * 2**20  # torch's cuBLAS workspace on Hopper (CUBLAS_WORKSPACE_CONFIG :4096:8)
# torch keeps one workspace per (cuBLAS handle, stream) and one handle per thread: the forward's thread and autograd's
# backward thread each allocate one
CUBLAS_WORKSPACES = 2
DEFAULT_GPU_MEMORY_GIB = 80.0


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The ZeRO settings that decide memory (elements, as in the DeepSpeed JSON)."""

    reduce_bucket_size: int = 50_000_000
    prefetch_bucket_size: int = 30_000_000
    param_persistence_threshold: int = 100_000
    max_reuse_distance: int = 1_000_000_000

    @classmethod
    def of(cls, layout: RunLayout) -> DeepSpeedSettings:
        """A hybrid run's settings, from the DeepSpeed file its layout read (the defaults for other modes)."""
        if layout.ds_file is None:
            return cls()
        zero = {**zero3_defaults(layout.cfg.parallel.zero3_fetch), **layout.ds_file.get("zero_optimization", {})}
        keys = {"reduce_bucket_size": "reduce_bucket_size", "prefetch_bucket_size": "stage3_prefetch_bucket_size",
                "param_persistence_threshold": "stage3_param_persistence_threshold",
                "max_reuse_distance": "stage3_max_reuse_distance"}
        return cls(**{ours: int(zero[theirs]) for ours, theirs in keys.items() if theirs in zero})


def model_name(cfg: RunConfig) -> str:
    """The --model preset's name, or "custom" when --n-layer/--n-head/--n-embd changed it."""
    preset = MODEL_PRESETS[cfg.train.model]
    custom = any(getattr(cfg.model, k) != v for k, v in preset.items() if k != "n_positions")
    return "custom" if custom else cfg.train.model


def layout_label(layout: RunLayout) -> str:
    return run_label(layout.mode, layout.zero_stage or 0, layout.tp_size, layout.sequence_parallel,
                     layout.zero_engine or "deepspeed")


@dataclass(frozen=True)
class Numerics:
    states: StateBytes  # bytes per parameter of weights, gradients, optimizer states; activation element size
    residual_bytes: int  # residual stream (LayerNorm inputs)
    autocast_copies: bool  # autocast saves a 16-bit copy of each weight for backward
    comm: StateBytes  # bytes per element of the weights and gradients ZeRO/DDP communicate


def numerics(layout: RunLayout) -> Numerics:
    precision, mode = layout.precision, layout.mode
    if precision == "fp32":
        fp32 = StateBytes(param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4)
        return Numerics(fp32, 4, False, fp32)
    if layout.fsdp2:  # fp32 master weights, gradients reduced in fp32, autocast for compute; the dtype the blocks
        # are gathered in: fsdp2_memory, fsdp2_communication
        return Numerics(AMP_FP32_WEIGHTS, 4, True, AMP_FP32_WEIGHTS)
    if mode == "hybrid" and layout.cfg.parallel.zero_precision == "deepspeed":  # a 16-bit model, fp32 master
        # weights and moments
        return Numerics(MIXED_PRECISION, 2, False, MIXED_PRECISION)
    if mode == "hybrid":  # DeepSpeed torch_autocast: Linear weights and gradients travel in 16 bits (the
        # embeddings and LayerNorms in fp32: zero3_fp32_traffic adds them to the communication, the memory terms
        # leave them out, 5% of GPT-2 Large's parameters, 31% of GPT-2's)
        return Numerics(AMP_FP32_WEIGHTS, 4, True, MIXED_PRECISION)
    return Numerics(AMP_FP32_WEIGHTS, 4, True, AMP_FP32_WEIGHTS)  # torch.autocast over fp32 weights


# ---------------------------------------------------------------- memory

@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU. `weight_copies`: autocast's 16-bit weight copies or ZeRO-3's gathered weights."""

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    weight_copies: float
    workspace: float
    step_transient: float  # gradients that exist only for the optimizer step

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def backward_peak(self) -> float:
        return self.states + self.activations + self.logits + self.weight_copies + self.workspace

    @property
    def step_peak(self) -> float:
        return self.states + self.step_transient + self.workspace

    @property
    def peak(self) -> float:
        return max(self.backward_peak, self.step_peak)

    def as_gib(self) -> dict[str, float]:
        terms = {k: v / GIB for k, v in asdict(self).items()}
        return {**terms, "peak": self.peak / GIB}


def zero3_held_params(layout: RunLayout) -> float:
    """Elements of gathered weights ZeRO-3 keeps alive when backward starts.

    With our blocks as DeepSpeed leaf modules (--zero3-fetch block or flat), every partitioned weight: the comms log
    shows no backward re-gathers at any reuse distance, and under flat the views autograd saves keep a unit's
    gathered storage alive (gpt2.runtime.flat_blocks). Per module (--zero3-fetch module), DeepSpeed's own rule:
    it releases a module's gathered weights after its forward unless one of them appears again among the next
    `stage3_max_reuse_distance` parameters of the recorded module order (forward, then backward in reverse);
    persistent parameters (`persists`) are never partitioned. The LM head reuses the tied word embedding, so that
    one is held from the embedding onwards.
    """
    cfg, ds = layout.cfg.model, DeepSpeedSettings.of(layout)
    if layout.zero3_blocks:
        return local_params(layout) - zero3_persistent_params(layout)
    return _zero3_held(cfg.n_layer, cfg.n_embd, cfg.n_positions, cfg.padded_vocab_size, layout.tp_size,
                       ds.param_persistence_threshold, ds.max_reuse_distance)


@functools.cache  # --search plans every layout of one model: a few distinct (tp, settings), many calls
def _zero3_held(n_layer: int, d: int, n_positions: int, padded_vocab: int, t: int, threshold: int,
                max_reuse_distance: int) -> float:
    """`zero3_held_params` in time linear in layers (a scan per module took minutes at 100k layers)."""
    vocab = ("wte", padded_vocab * d / t)
    blocks = []
    for i in range(n_layer):
        blocks += [(f"{i}.ln_1", 2 * d), (f"{i}.c_attn", (3 * d * d + 3 * d) / t), (f"{i}.attn_proj", d * d / t + d),
                   (f"{i}.ln_2", 2 * d), (f"{i}.c_fc", (4 * d * d + 4 * d) / t), (f"{i}.mlp_proj", 4 * d * d / t + d)]
    forward = [vocab, ("wpe", n_positions * d), *blocks, ("ln_f", 2 * d), vocab]
    trace = forward + forward[::-1]
    # where each module comes next in the trace, and the elements before each position: the distance to a reuse
    # is one subtraction
    before = list(itertools.accumulate((numel for _, numel in trace), initial=0.0))
    next_use: list[int | None] = [None] * len(trace)
    seen: dict[str, int] = {}
    for k in range(len(trace) - 1, -1, -1):
        next_use[k] = seen.get(trace[k][0])
        seen[trace[k][0]] = k
    held: dict[str, float] = {}
    for i, (name, numel) in enumerate(forward):
        if persists(numel, threshold):
            continue  # persistent: counted nowhere (a few small vectors)
        held.pop(name, None)
        j = next_use[i]
        if j is not None and before[j] - before[i + 1] < max_reuse_distance:
            held[name] = numel
    return sum(held.values())


def persists(numel: float, threshold: int) -> bool:
    """Whether ZeRO-3 keeps a parameter whole on every rank: DeepSpeed persists one of `ds_numel <=
    stage3_param_persistence_threshold` (partition_parameters.py)."""
    return numel <= threshold


def zero3_reduce_bucket_bytes(layout: RunLayout) -> int:
    """Bytes per element of DeepSpeed ZeRO-3's gradient reduce buckets: stage3.py allocates one bucket of
    `reduce_bucket_size` elements per communication dtype (contiguous_gradients), i.e. under torch_autocast a 16-bit
    one for the Linears' gradients and an fp32 one for the embeddings' and LayerNorms' (zero3_fp32_params); one
    bucket of the gradients' dtype otherwise."""
    num = numerics(layout)
    if num.comm.grad_bytes < num.states.grad_bytes:  # two communication dtypes
        return num.comm.grad_bytes + num.states.grad_bytes
    return num.comm.grad_bytes


def zero3_persistent_params(layout: RunLayout) -> float:
    """Elements of the parameters ZeRO-3 never partitions (`persists`)."""
    cfg, t, threshold = layout.cfg.model, layout.tp_size, DeepSpeedSettings.of(layout).param_persistence_threshold
    d = cfg.n_embd
    block = [d, d, 3 * d * d / t, 3 * d / t, d * d / t, d, d, d, 4 * d * d / t, 4 * d / t, 4 * d * d / t, d]
    once = [cfg.padded_vocab_size * d / t, cfg.n_positions * d, d, d]
    return (sum(n for n in once if persists(n, threshold))
            + cfg.n_layer * sum(n for n in block if persists(n, threshold)))


def zero3_fp32_params(layout: RunLayout) -> tuple[float, float]:
    """Elements DeepSpeed's torch_autocast keeps in fp32 through ZeRO-3's collectives: every parameter outside its
    lower-precision modules (gpt2.config.deepspeed_file's: the Linears, biases included), i.e. the word and position
    embeddings and the LayerNorms. As (gathered, persistent): a persistent tensor (`persists`) is never gathered,
    only refreshed after the step. Their gradients are all reduce-scattered."""
    cfg, t, threshold = layout.cfg.model, layout.tp_size, DeepSpeedSettings.of(layout).param_persistence_threshold
    d = cfg.n_embd
    tensors = [cfg.padded_vocab_size * d / t, cfg.n_positions * d] + [d] * (4 * cfg.n_layer + 2)  # LN weight, bias
    persistent = sum(n for n in tensors if persists(n, threshold))
    return sum(tensors) - persistent, persistent


def loss_bytes(layout: RunLayout, tokens: int, e: int) -> float:
    """Peak bytes of the LM head's loss per GPU (see the module docstring)."""
    cfg, t = layout.cfg.model, layout.cfg.train
    vp, v = cfg.padded_vocab_size, cfg.vocab_size
    if layout.tp_size > 1:
        return tokens * vp / layout.tp_size * (2 * FP32_BYTES + (e if e < FP32_BYTES else 0))
    whole_graph = torch_compiles_whole_model(layout.cfg)
    if fused_head_runs(t.fused_kernels, inductor_head=inductor_compiles_head(layout.cfg),
                       whole_model_graph=whole_graph):  # the chunked cross-entropy
        chunk = lm_head_chunk_rows(tokens, vp) * vp  # logits
        unnamed = tokens * vp * e if whole_graph else 0  # measured, not yet named: see the module docstring
        return chunk * e + unnamed + FP32_BYTES * vp * cfg.n_embd + FP32_BYTES * tokens * cfg.n_embd
    if t.compile:  # the 16-bit logits saved; a whole-model graph writes their gradient to a second buffer, the
        # head's own graph (per-part scopes) into the saved one (a donated buffer: its backward is its last reader)
        return tokens * vp * e * (2 if layout.compile_scope == "model" else 1)
    return tokens * v * 3 * FP32_BYTES


@dataclass(frozen=True)
class GatheredInputs:
    """Column-parallel layers that keep their all-gathered, full-sequence input for backward under sequence
    parallelism (per block, and the LM head). The others keep their shard and all-gather it again in backward."""

    per_block: int  # of c_attn and c_fc
    lm_head: int

    def regathered(self, n_layer: int) -> int:
        """Backward all-gathers of a saved shard per micro-step: the column layers that keep only their shard."""
        return n_layer * (2 - self.per_block) + 1 - self.lm_head


def sp_gathered_inputs(layout: RunLayout) -> GatheredInputs:
    """Under --sequence-parallel, which column-parallel layers save the all-gathered input `[B, T, d]` (what their
    matmul reads) instead of their `[B, T/tp, d]` shard, the Korthikanti et al. assumption of layer_activation_bytes.
    Only parallel.layers' overlapped path (`_ColumnParallelMatmul`: eager, `--tp-overlap` on, no fused GELU) saves
    the shard and gathers again in backward; `--compile` traces the plain path inside the blocks, and the MLP
    up-projection (GELU fused into its matmul) always takes it. The vocab-parallel LM head is never compiled
    (gpt2.runtime.compiling.compiled_parts), so it keeps its shard whenever --tp-overlap is on. Planning the shard
    everywhere under-predicted a ZeRO-3 + TP2 + SP run's peak (docs/decisions.md)."""
    if not layout.sequence_parallel or layout.tp_size == 1:
        return GatheredInputs(0, 0)
    overlap = layout.cfg.parallel.tp_overlap
    if not overlap:
        return GatheredInputs(2, 1)  # every column layer takes the plain path
    return GatheredInputs(2 if layout.cfg.train.compile else 1, 0)  # c_fc, and c_attn when compiled


def predict_memory(layout: RunLayout) -> MemoryPlan:
    cfg, tc, num = layout.cfg.model, layout.cfg.train, numerics(layout)
    e, r = num.states.activation_bytes, num.residual_bytes
    states = memory_per_gpu(layout, num.states)
    b, seq, d, t, sp = tc.batch_size, tc.seq_len, cfg.n_embd, layout.tp_size, layout.sequence_parallel
    sbh_shard = seq * b * d / (t if sp else 1)  # one replicated [b, s, h] element count
    layer = layer_activation_bytes(cfg, b, seq, t, sp, activation_bytes=e, residual_bytes=r)
    unit = layout.checkpointed_blocks  # blocks a checkpoint recomputes: a block, or a ZeRO-3 (or flat FSDP2) unit
    # a unit of several blocks compiled as one graph (DeepSpeed's leaf units, FSDP2's units): every block but a unit's
    # first keeps its residual-stream tensor in fp32, not the 16 bits above (module docstring: measured, mechanism not
    # pinned down)
    entries = -(-cfg.n_layer // layout.block_unit_blocks)  # entries of model.blocks; FSDP2's last unit may be short
    inner = 0.0
    if tc.compile:
        layer -= (r - e) * sbh_shard  # inductor keeps one fp32 residual-stream tensor in 16 bits
        if not num.autocast_copies:  # 16-bit model (DeepSpeed): the GELU output is recomputed in backward
            layer -= 4 * e * b * seq * d / t
        if layout.zero3_blocks or layout.fsdp2:  # each entry of model.blocks its own graph (compile_forwards)
            inner = (r - e) * sbh_shard
    gathered = sp_gathered_inputs(layout)
    gathered_beyond_shard = e * b * seq * d * (1 - 1 / t)  # one [b, s, d] input kept whole instead of its shard
    layer += gathered.per_block * gathered_beyond_shard
    if tc.activation_checkpointing:
        activations = cfg.n_layer // unit * r * sbh_shard + unit * layer + (unit - 1) * inner  # unit inputs + one
        # recomputed unit
    else:
        activations = cfg.n_layer * layer + (cfg.n_layer - entries) * inner
    activations += (r + e) * sbh_shard  # ln_f input (residual stream) and output
    activations += gathered.lm_head * gathered_beyond_shard
    logits = loss_bytes(layout, b * seq, e)

    n_local = local_params(layout)
    copies = 0.0
    if num.autocast_copies:
        if layout.fsdp2_gather_dtype:  # FSDP2 gathering the blocks in bf16: autocast copies only the root's weights
            n_copied = local_root_params(layout)
        elif tc.activation_checkpointing:  # recomputation makes the copies again, one block (or unit) at a time
            n_copied = cfg.padded_vocab_size * d / t + unit * (12 * d * d + 7 * d) / t
        else:
            n_copied = n_local
        copies = e * n_copied
    workspace = float(CUBLAS_WORKSPACES * CUBLAS_WORKSPACE_BYTES)
    step_transient = 0.0
    grads = states.grads
    if gradients_made_in_backward(layout):
        grads, step_transient = 0.0, states.grads
    if layout.fsdp2:
        held, grads = fsdp2_memory(layout, n_local)
        copies += held
        step_transient = states.grads  # the sharded gradients: made in backward, freed after the step
    elif layout.mode == "hybrid":
        ds, zero = DeepSpeedSettings.of(layout), zero_stage_of(layout)
        workspace += ds.reduce_bucket_size * (zero3_reduce_bucket_bytes(layout) if zero == 3 else e)
        if zero == 3:  # gathered weights held to their backward, in the weights' dtype
            workspace += ds.prefetch_bucket_size * e
            # on one data-parallel rank ZeRO-3 gathers nothing: a parameter's data is its partition
            # (partition_parameters.py, _no_gather_coalesced), already counted in `params`
            held = zero3_held_params(layout) if layout.dp_size > 1 else 0.0
            copies = copies + FP32_BYTES * held if num.autocast_copies else e * held
        if layout.precision != "fp32" and not num.autocast_copies:  # the 16-bit model's fp32 gradient copy
            step_transient = FP32_BYTES * n_local / (layout.dp_size if zero >= 1 else 1)
    return MemoryPlan(states.params, grads, states.optimizer, activations, logits, copies, workspace, step_transient)


def gradients_made_in_backward(layout: RunLayout) -> bool:
    """Whether a `--mode single` step holds no gradient when its backward starts: `TorchEngine.optimizer_step` ends
    with `zero_grad(set_to_none=True)`, so autograd creates each .grad during the backward, as the saved tensors it
    follows are freed; the gradients count at the optimizer step only. DDP's are views of its reducer's buckets,
    which live as long as the reducer (gradient_as_bucket_view); with --grad-accum > 1 every micro-step after the
    first starts its backward with all of them."""
    return layout.mode == "single" and layout.grad_accum == 1


def fsdp2_units(layout: RunLayout) -> tuple[float, float]:
    """Elements of one rank's FSDP2 units (gpt2.engines.fsdp2_engine.shard_model) gathered when backward starts:
    the last block unit (gathered again for backward; --fsdp2-unit-blocks blocks, or what is left of them: TP-local),
    and the root (token embedding shard, tied to the head; position embedding; final LayerNorm:
    `local_root_params`). The unit before the last is prefetched once the last one's backward starts, when the loss
    buffers are already freed: a later, smaller moment."""
    per_unit, layers = layout.fsdp2_unit_blocks, layout.cfg.model.n_layer
    last = layers - per_unit * ((layers - 1) // per_unit)  # the last unit's blocks: 1 .. per_unit
    return last * local_block_params(layout), local_root_params(layout)


def fsdp2_memory(layout: RunLayout, n_local: float) -> tuple[float, float]:
    """(bytes of gathered weights held when backward starts, bytes of the gradients then), for `predict_memory`.

    --zero-stage 3 (reshard_after_forward=True): the root unit, which FSDP2 does not reshard after forward, and the
    last block unit, gathered for backward. --zero-stage 2 (False): every unit stays gathered from its forward to its
    backward: the whole TP-local model. The root in fp32, the blocks in their gather dtype (--fsdp2-gather).
    Gradients: none (the reduce-scatters make them, one unit at a time, during backward) unless --grad-accum > 1,
    where FSDP2 keeps every unit's unsharded gradient across the micro-steps (no sync but on the last), in fp32
    (the reduce dtype).
    """
    last_unit, root = fsdp2_units(layout)
    blocks = last_unit if layout.zero_stage == 3 else n_local - root
    held = FP32_BYTES * root + fsdp2_block_gather_bytes(layout) * blocks
    grads = FP32_BYTES * n_local if layout.grad_accum > 1 else 0.0
    return held, grads


def fsdp2_block_gather_bytes(layout: RunLayout) -> int:
    """Bytes per element of the blocks' gathered weights under FSDP2 (--fsdp2-gather): 2 for bf16, else 4."""
    dtype = layout.fsdp2_gather_dtype
    return dtype.itemsize if dtype is not None else FP32_BYTES


def fsdp2_communication(layout: RunLayout, ops: list[CommOp]) -> list[CommOp]:
    """perf_model's ZeRO DP collectives replaced by FSDP2's: each unit gathered (the root in fp32, the blocks in
    their gather dtype) before its forward on every micro-step and, at stage 3, again before its backward (not the
    root: FSDP2 keeps it gathered); the gradients reduce-scattered in fp32 once a step
    (set_requires_gradient_sync(False) on the other micro-steps)."""
    n, root, m, dp = local_params(layout), local_root_params(layout), layout.grad_accum, layout.dp_size
    blocks = (n - root) * fsdp2_block_gather_bytes(layout)
    ops = [op for op in ops if op.group != "dp"]
    if dp > 1:
        ops.append(CommOp("FSDP2 param all-gather (fwd)", "dp", "all_gather", dp, root * FP32_BYTES + blocks, m))
        if layout.zero_stage == 3:
            ops.append(CommOp("FSDP2 param all-gather (bwd)", "dp", "all_gather", dp, blocks, m))
        ops.append(CommOp("FSDP2 grad reduce-scatter", "dp", "reduce_scatter", dp, n * FP32_BYTES, 1))
    return ops


# ---------------------------------------------------------------- communication

def predict_communication(layout: RunLayout) -> list[CommOp]:
    """Collectives one GPU takes part in per optimizer step: perf_model's, plus our TP implementation's extras."""
    num, cfg, tc = numerics(layout), layout.cfg.model, layout.cfg.train
    ops = step_communication(layout, num.comm)
    if layout.fsdp2:
        ops = fsdp2_communication(layout, ops)
    elif layout.zero_stage == 3 and layout.dp_size > 1:
        ops = zero3_gathers(layout, ops, num.comm.param_bytes)
        if layout.cfg.parallel.zero_precision == "autocast" and num.comm.param_bytes < FP32_BYTES:
            # DeepSpeed's torch_autocast: the Linears travel in 16 bits, the rest in fp32
            ops = zero3_fp32_traffic(layout, ops, FP32_BYTES - num.comm.param_bytes)
    if layout.tp_size > 1:
        t, m, tokens = layout.tp_size, layout.grad_accum, tc.batch_size * tc.seq_len
        if tc.activation_checkpointing and cfg.dropout == 0:
            # perf_model counts Megatron's full recomputed forward (2 more collectives per layer). torch's
            # non-reentrant checkpoint stops recomputing at the checkpointed block's (or ZeRO-3 unit's) last saved
            # tensor (its last MLP c_proj input), so that MLP output's all-reduce / reduce-scatter is not rerun
            # (its dropout mask would be); inside a unit the other blocks' are
            skip = "activation reduce-scatter (SP)" if layout.sequence_parallel else "activation all-reduce"
            segments = cfg.n_layer // layout.checkpointed_blocks
            ops = [replace(op, calls=op.calls - m * segments) if op.name == skip else op for op in ops]
        act = tokens * cfg.n_embd * num.states.activation_bytes
        ops.append(CommOp("top-1 all-reduce (int64)", "tp", "all_reduce", t, tokens * 8, m))
        if layout.sequence_parallel:
            d, L = cfg.n_embd, cfg.n_layer
            ops.append(CommOp("position-embedding grad all-gather (SP)", "tp", "all_gather", t,
                              tc.seq_len * d * num.states.activation_bytes, m))
            # DDP/single/FSDP2: one coalesced all-reduce after the last micro-step; DeepSpeed: per-parameter hooks
            # in every backward (ZeRO consumes gradients during backward), so once per micro-step
            ops.append(CommOp("SP replicated-param grad all-reduce", "tp", "all_reduce", t,
                              (6 * L + 2) * d * num.states.grad_bytes,
                              m if layout.mode == "hybrid" and not layout.fsdp2 else 1))
            regathered = sp_gathered_inputs(layout).regathered(L)  # the overlapped path's saved shards
            if regathered:
                ops.append(CommOp("recomputed input all-gather (SP overlap)", "tp", "all_gather", t, act,
                                  m * regathered))
    return ops


def zero3_gathers(layout: RunLayout, ops: list[CommOp], param_bytes: int) -> list[CommOp]:
    """perf_model's ZeRO-3 all-gathers (every weight in forward and again in backward), as DeepSpeed runs them
    after its first step (the one that records the parameter trace and gathers every use separately):
    persistent parameters are not gathered in forward or backward but refreshed once after the optimizer step;
    weights reused within `stage3_max_reuse_distance` stay gathered from forward to backward
    (`zero3_held_params`, the memory model's term), so backward gathers only the others."""
    persistent, held = zero3_persistent_params(layout), zero3_held_params(layout)
    out = []
    for op in ops:
        if op.name == "param all-gather (fwd)":
            out.append(replace(op, message_bytes=op.message_bytes - persistent * param_bytes))
            out.append(replace(op, name="persistent param all-gather (after step)",
                               message_bytes=persistent * param_bytes, calls=1))
        elif op.name == "param all-gather (bwd)":
            out.append(replace(op, message_bytes=op.message_bytes - (persistent + held) * param_bytes))
        else:
            out.append(op)
    return out


def zero3_fp32_traffic(layout: RunLayout, ops: list[CommOp], extra_bytes: int) -> list[CommOp]:
    """`zero3_gathers`' ops with the embeddings' and LayerNorms' fp32 bytes added (`zero3_fp32_params`): their
    gradients in the reduce-scatter, their weights in the forward gathers or the after-step refresh. (Held from
    forward to backward, the embeddings are not gathered again; a LayerNorm re-gathered in backward, 2d elements a
    block, is left out.) This is the whole difference between the plan and `--comm-log` for GPT-2 Large's
    reduce-scatter (docs/decisions.md)."""
    gathered, persistent = zero3_fp32_params(layout)
    more = {"grad reduce-scatter": gathered + persistent, "param all-gather (fwd)": gathered,
            "persistent param all-gather (after step)": persistent}
    return [replace(op, message_bytes=op.message_bytes + more.get(op.name, 0.0) * extra_bytes) for op in ops]


def tp_payload_bytes(ops: list[CommOp]) -> float:
    """Logical bytes of the TP collectives per step: what parallel.comm.CommStats counts."""
    return sum(op.message_bytes * op.calls for op in ops if op.group == "tp")


def payload_by_collective(ops: list[CommOp], group: str) -> dict[str, float]:
    """Logical bytes per step of one group's collectives (tp: what CommStats counts; dp: ZeRO's), by kind."""
    out: dict[str, float] = {}
    for op in ops:
        if op.group == group:
            out[op.collective] = out.get(op.collective, 0.0) + op.message_bytes * op.calls
    return out


# ---------------------------------------------------------------- the plan of one run

@dataclass(frozen=True)
class Plan:
    layout: RunLayout
    memory: MemoryPlan
    comm: list[CommOp]
    gpu_memory_gib: float
    headroom: float = 0.05  # CUDA context + allocator fragmentation outside `allocated`, as a fraction

    @property
    def usable_gib(self) -> float:
        """The GPU memory a run's allocations may take: all of it but the headroom."""
        return self.gpu_memory_gib * (1 - self.headroom)

    @property
    def fits(self) -> bool:
        return self.memory.peak / GIB <= self.usable_gib

    @property
    def checkpoint_bytes(self) -> float:
        """One checkpoint's size, every rank's files together: the weights and optimizer states each GPU holds, each
        distinct shard once (data-parallel replicas save theirs once; the per-rank RNG files are a few KB). GPT-2
        tiny single: 40.03 MB predicted, 40.08 MB written."""
        layout, mem = self.layout, self.memory
        zero, dp = zero_stage_of(layout), layout.dp_size
        return layout.tp_size * (mem.params * (dp if zero == 3 else 1) + mem.optimizer * (dp if zero >= 1 else 1))

    def record(self) -> dict[str, Any]:
        """Flat `plan/...` keys for the summary record, JSONL and wandb."""
        out: dict[str, Any] = {f"plan/{k}_gib": v for k, v in self.memory.as_gib().items()}
        out.update({"plan/gpu_memory_gib": self.gpu_memory_gib, "plan/fits": self.fits,
                    "plan/tp_payload_bytes": tp_payload_bytes(self.comm)})
        for group in ("tp", "dp"):
            payload = payload_by_collective(self.comm, group)
            out.update({f"plan/{group}_payload_bytes/{k}": v for k, v in payload.items()})
        for op in self.comm:
            out[f"plan/comm/{op.group} {op.name}/wire_bytes"] = op.wire_bytes
        return out


def make_plan(layout: RunLayout, gpu_memory_gib: float) -> Plan:
    return Plan(layout, predict_memory(layout), predict_communication(layout), gpu_memory_gib)


def device_memory_gib(requested: float | None) -> float:
    """--gpu-memory-gib, else the current CUDA device's memory, else 80."""
    if requested is not None:
        return requested
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    return DEFAULT_GPU_MEMORY_GIB


def format_plan(plan: Plan) -> str:
    layout, m = plan.layout, plan.memory
    cfg, t = layout.cfg.model, layout.cfg.train
    lines = [
        f"plan: {model_name(layout.cfg)} ({cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads), "
        f"{layout_label(layout)}, {layout.world_size} GPUs (tp {layout.tp_size} x dp {layout.dp_size}), micro-batch "
        f"{t.batch_size} x accum {layout.grad_accum}, seq {t.seq_len}, {layout.precision}"
        f"{', compile' if t.compile else ''}{', activation checkpointing' if t.activation_checkpointing else ''}",
        "memory per GPU (GiB):",
    ]
    names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
             "activations": "activations (saved by blocks)", "logits": "logits / loss buffers",
             "weight_copies": "16-bit weight copies / ZeRO-3 held weights", "workspace": "workspace (cuBLAS, buckets)",
             "step_transient": "gradients made for the optimizer step"}
    for key, gib in m.as_gib().items():
        if key != "peak":
            lines.append(f"  {names[key]:<44} {gib:8.2f}")
    phase = "backward start" if m.backward_peak >= m.step_peak else "optimizer step"
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  {'predicted peak allocated (' + phase + ')':<44} {m.peak / GIB:8.2f}  -> {verdict} in "
                 f"{plan.gpu_memory_gib:.1f} GiB ({100 * plan.headroom:.0f}% kept for context/fragmentation)")
    lines.append("communication per step and GPU (ring model; wire = bytes through this GPU's link):")
    if not plan.comm:
        lines.append("  none")
    for op in plan.comm:
        lines.append(f"  {op.group} {op.name:<42} {op.calls:5d} x {op.message_bytes / 2**20:10.2f} MiB  "
                     f"wire {op.wire_bytes / GIB:8.3f} GiB")
    if layout.tp_size > 1:
        lines.append(f"  TP payload (what CommStats counts): {tp_payload_bytes(plan.comm) / GIB:.3f} GiB")
    return "\n".join(lines)


def plan_for_run(layout: RunLayout) -> Plan:
    """The plan of a launched run (CPU runs train in fp32 whatever --precision says: the layout's precision)."""
    return make_plan(layout, device_memory_gib(layout.cfg.plan.gpu_memory_gib))


def compare_with_run(plan: Plan, summary: dict[str, Any], tp_bytes_per_step: dict[str, float] | None,
                     dp_bytes_per_step: dict[str, float] | None = None) -> dict[str, Any]:
    """Predicted next to measured, for the summary record. Memory is compared on CUDA only (CPU reports RSS).

    `tp_bytes_per_step` / `dp_bytes_per_step`: measured payload per step by collective kind
    (`gpt2.observe.metrics.TrainingCommMeter.per_step`); DP is measured only with --comm-log (DeepSpeed's comms logger).
    """
    out = plan.record()
    measured = summary.get("mem/peak_allocated_gib")
    on_gpu = summary.get("device", "cpu") != "cpu"
    out["plan/measured_peak_gib"] = measured if on_gpu else None
    out["plan/peak_error"] = (plan.memory.peak / GIB - measured) / measured if on_gpu and measured else None
    if plan.layout.tp_size > 1:
        if tp_bytes_per_step is None:
            out["plan/measured_tp_payload_bytes"] = None
            out["plan/comm_note"] = "TP bytes not measured: the engine exposes no CommStats; predicted only"
        else:
            out["plan/measured_tp_payload_bytes"] = sum(tp_bytes_per_step.values())
            out.update({f"plan/measured_tp_payload_bytes/{k}": v for k, v in tp_bytes_per_step.items()})
    if dp_bytes_per_step is not None:
        out.update({f"plan/measured_dp_payload_bytes/{k}": v for k, v in dp_bytes_per_step.items()})
    return out


# ---------------------------------------------------------------- layout search

@dataclass(frozen=True)
class Hardware:
    """Assumptions of the step-time model, printed with every search."""

    gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB
    achievable_tflops: float = 400.0  # sustained bf16 matmul rate per GPU (~40% of a 989 TFLOP/s dense peak)
    busbw_intra_gbs: float = 350.0  # collective bus bandwidth within a node (NVLink)
    busbw_inter_gbs: float = 40.0  # ... of a group spanning nodes (e.g. one 400 Gb/s NIC per GPU)
    gpus_per_node: int = 8

    def describe(self) -> str:
        return (f"assumptions: {self.achievable_tflops:g} TFLOP/s achieved per GPU on model FLOPs (x4/3 with "
                f"activation checkpointing); bus bandwidth {self.busbw_intra_gbs:g} GB/s within a node of "
                f"{self.gpus_per_node} GPUs, {self.busbw_inter_gbs:g} GB/s for a group spanning nodes (ring model); "
                f"TP groups are consecutive ranks (inside a node); TP collectives are exposed; DP collectives "
                f"overlap with compute (exposed only beyond it); fits = predicted peak <= "
                f"{self.gpu_memory_gib:g} GiB minus 5%")


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_comm_s + max(0.0, self.dp_comm_s - self.compute_s)

    @property
    def tokens_per_s(self) -> float:
        return self.plan.layout.tokens_per_step / self.step_s


def step_time(plan: Plan, hw: Hardware) -> Candidate:
    layout, t = plan.layout, plan.layout.cfg.train
    flops = (hardware_flops_per_token(layout.cfg.model, t.seq_len, t.activation_checkpointing)
             * layout.tokens_per_step)
    compute = flops / (layout.world_size * hw.achievable_tflops * 1e12)
    intra, inter = hw.busbw_intra_gbs * 1e9, hw.busbw_inter_gbs * 1e9
    dp_bw = intra if layout.world_size <= hw.gpus_per_node else inter
    tp_s = sum(op.time(intra) for op in plan.comm if op.group == "tp")
    dp_s = sum(op.time(dp_bw) for op in plan.comm if op.group == "dp")
    return Candidate(plan, compute, tp_s, dp_s)


def candidate_layout(cfg: RunConfig, world_size: int, mode: str, zero_stage: int, tp_size: int,
                     sequence_parallel: bool, activation_checkpointing: bool, micro_batch: int,
                     grad_accum: int) -> RunLayout:
    """`cfg` with the layout flags a search varies, compiled per block (torch.compile, no fused loss), resolved on
    `world_size` GPUs as its launch would be: the same RunLayout, DeepSpeed file (that --zero-stage's stock one)
    and checks."""
    t, p = cfg.train, cfg.parallel
    train = replace(t, mode=mode, batch_size=micro_batch, grad_accum=grad_accum, global_batch_size=None,
                    activation_checkpointing=activation_checkpointing, compile=True, compiler="torch",
                    compile_scope=resolve_compile_scope("auto", mode, tp_size, "torch"),
                    fused_kernels="none" if t.fused_kernels == "triton" else t.fused_kernels)
    parallel = replace(p, tp_size=tp_size, sequence_parallel=sequence_parallel, ds_config=None,
                       zero_stage=zero_stage if mode == "hybrid" else p.zero_stage)
    return RunLayout.resolve(replace(cfg, train=train, parallel=parallel), world_size, "cuda")


def search(cfg: RunConfig, world_size: int, global_batch: int, hw: Hardware) -> list[Candidate]:
    """Every layout of `world_size` GPUs that fits, fastest first (ties: less memory first).

    Varied: mode (DDP, ZeRO-1/2/3), TP size (dividing heads, width and vocab; within a node), sequence
    parallelism, activation checkpointing, micro-batch (powers of two and the whole per-replica batch; the
    rest is gradient accumulation). --compile is on everywhere (ZeRO-3 compiles its blocks inside per-block gathers).
    """
    out = []
    g = world_size
    for tp in (t for t in (1, 2, 4, 8)
               if tp_divides_world(g, t) and t <= hw.gpus_per_node and tp_divides_model(cfg.model, t)):
        dp = dp_size_of(g, tp)
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        micros = sorted({2**k for k in range(int(math.log2(per_replica)) + 1) if per_replica % 2**k == 0}
                        | {per_replica})
        modes = [("baseline", 0)] + [("hybrid", z) for z in (1, 2, 3)]
        for (mode, zero), sp, ckpt, mb in (
                (m, sp, c, mb) for m in modes for sp in ({False, tp > 1}) for c in (False, True) for mb in micros):
            if sp and not sequence_splits(cfg.train.seq_len, tp):
                continue
            layout = candidate_layout(cfg, g, mode, zero, tp, sp, ckpt, mb, per_replica // mb)
            plan = make_plan(layout, hw.gpu_memory_gib)
            if plan.fits:
                out.append(step_time(plan, hw))
    return sorted(out, key=lambda c: (c.step_s, c.plan.memory.peak))


def format_search(cfg: RunConfig, world_size: int, global_batch: int, hw: Hardware, ranked: list[Candidate],
                  top: int = 10) -> str:
    m = cfg.model
    lines = [f"search: {model_name(cfg)} ({m.n_layer} layers, d={m.n_embd}, {m.n_head} heads), "
             f"{world_size} GPUs of {hw.gpu_memory_gib:g} GiB, global batch {global_batch} x seq "
             f"{cfg.train.seq_len}, {cfg.train.precision}", hw.describe()]
    if not ranked:
        lines.append("no layout fits; try more GPUs, a smaller global batch or a shorter sequence")
        return "\n".join(lines)
    lines.append(f"{len(ranked)} layouts fit; the fastest {min(top, len(ranked))}:")
    lines.append("| rank | layout | tp x dp | micro x accum | ckpt | peak GiB | compute s | TP comm s | DP comm s "
                 "| step s | tokens/s |")
    lines.append("|" + "---|" * 11)
    for i, c in enumerate(ranked[:top], 1):
        layout = c.plan.layout
        lines.append(f"| {i} | {layout_label(layout)} | {layout.tp_size} x {layout.dp_size} | "
                     f"{layout.cfg.train.batch_size} x {layout.grad_accum} | "
                     f"{'yes' if layout.cfg.train.activation_checkpointing else 'no'} | "
                     f"{c.plan.memory.peak / GIB:.1f} | {c.compute_s:.3f} | {c.tp_comm_s:.3f} | {c.dp_comm_s:.3f} | "
                     f"{c.step_s:.3f} | {c.tokens_per_s:,.0f} |")
    return "\n".join(lines)


def planned_world_size(requested: int | None) -> int:
    return requested if requested is not None else env_int("WORLD_SIZE", 1, minimum=1)


def run_plan_cli(cfg: RunConfig) -> int:
    """`train.py --plan [--search]`: print and exit; no process group, data or GPU needed."""
    pc = cfg.plan
    try:
        world = planned_world_size(pc.gpus)
        # --search varies the layout itself (each candidate resolved as its launch would be); the given tp-size must
        # still fit the world. A plain plan makes the launch-time checks, and --global-batch-size -> grad_accum for
        # this world size, on GPUs.
        if pc.search:
            check_tp_divides_world(world, cfg.parallel.tp_size)
        else:
            layout = RunLayout.resolve(cfg, world, "cuda")
    except ConfigError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    memory = device_memory_gib(pc.gpu_memory_gib)
    if not pc.search:
        print(format_plan(make_plan(layout, memory)))
        return 0
    intra, inter = (pc.busbw_gbs + pc.busbw_gbs[-1:])[:2]
    hw = Hardware(gpu_memory_gib=memory, achievable_tflops=pc.achievable_tflops, busbw_intra_gbs=intra,
                  busbw_inter_gbs=inter)
    global_batch = cfg.train.global_batch_size or cfg.train.batch_size * world
    print(format_search(cfg, world, global_batch, hw, search(cfg, world, global_batch, hw)))
    return 0
