"""RunLayout: the run's resolved facts, decided once from (parsed config, world size, device).

`gpt2.config.schema` turns argv into a `RunConfig` and checks what needs nothing else. Everything that also depends on
the launch is decided here, once, and read by the engines, the trainer, the checkpoint meta, the planner and
`slurm/preflight.py`: the tp x dp sizes, gradient accumulation (from --global-batch-size), the precision that
actually runs (CPU runs are fp32 whatever --precision says) and its autocast dtype, the compile scope, the ZeRO
stage and DeepSpeed config file, and the tensor/sequence-parallel facts. Every rule that needs the world size is
checked in `RunLayout.resolve`, in the order a launch meets them. The parsed config is never mutated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from gpt2.config.deepspeed_file import ds_config_file, read_ds_file
from gpt2.config.schema import (
    DEEPCOMPILE_RECOMPILE_STEP,
    FSDP2_UNIT_BLOCKS,
    PROFILED_STEPS,
    ZERO3_UNIT_BLOCKS,
    ConfigError,
    ModelConfig,
    RunConfig,
    compile_label,
    unit_divisors,
)
from parallel.dims import dp_size_of, tp_divides_world


def check_tp_divides_world(world_size: int, tp_size: int) -> None:
    """tp x dp = world size: a tp-size that does not divide it is an error listing the sizes that do."""
    if not tp_divides_world(world_size, tp_size):
        choices = [d for d in range(1, world_size + 1) if tp_divides_world(world_size, d)]
        raise ConfigError(f"world size {world_size} is not divisible by --tp-size {tp_size}; "
                          f"choose --tp-size from {choices}")


def tp_split_shapes(cfg: ModelConfig) -> list[tuple[str, int, str]]:
    """(what, size, the flag that changes it) for every shape tensor parallelism splits."""
    return [
        ("n_head", cfg.n_head, "--n-head"),
        ("4*n_embd (MLP width)", 4 * cfg.n_embd, "--n-embd"),
        ("padded vocab", cfg.padded_vocab_size, "vocab padding (drop --no-pad-vocab)"),
    ]


def tp_divides_model(cfg: ModelConfig, tp_size: int) -> bool:
    return all(value % tp_size == 0 for _, value, _ in tp_split_shapes(cfg))


def check_tp_divides_model(cfg: ModelConfig, tp_size: int) -> None:
    """Shapes that tensor parallelism splits must divide by tp_size."""
    if tp_size == 1:
        return
    checks = tp_split_shapes(cfg)
    common = math.gcd(*(value for _, value, _ in checks))
    usable = [d for d in range(1, min(common, 64) + 1) if common % d == 0]  # divide every split shape
    for what, value, knob in checks:
        if value % tp_size:
            raise ConfigError(f"--tp-size {tp_size} does not divide {what} = {value}; choose --tp-size "
                              f"from {usable} (they divide n_head, 4*n_embd and the padded vocab) "
                              f"or change {knob}")


def sequence_splits(seq_len: int, tp_size: int) -> bool:
    """Whether sequence parallelism can shard the sequence into tp_size equal blocks."""
    return seq_len % tp_size == 0


def check_sequence_split(seq_len: int, tp_size: int, sequence_parallel: bool) -> None:
    """Sequence parallelism shards the sequence into tp_size equal blocks."""
    if sequence_parallel and tp_size > 1 and not sequence_splits(seq_len, tp_size):
        raise ConfigError(f"--sequence-parallel needs --seq-len divisible by --tp-size {tp_size}, "
                          f"got {seq_len}; use --seq-len {seq_len - seq_len % tp_size} or drop "
                          f"--sequence-parallel")


def run_precision(requested: str, device_type: str) -> str:
    """The precision that runs: --precision on GPU; CPU runs are always fp32."""
    return requested if device_type == "cuda" else "fp32"


LEAF_FETCHES = ("block", "flat")  # --zero3-fetch values that make transformer blocks DeepSpeed leaf modules


def largest_divisor_up_to(n_layer: int, cap: int) -> int:
    """The largest unit of at most `cap` blocks that divides the model's `n_layer` blocks into units of one size."""
    return max(n for n in unit_divisors(n_layer) if n <= cap)


def zero3_unit_blocks_of(fetch: str | None, given: int | None, n_layer: int) -> int:
    """Transformer blocks per DeepSpeed ZeRO-3 leaf module: 1 unless `fetch` (--zero3-fetch as it applies; None: no
    gather hooks) makes blocks leaves; else `given` (--zero3-unit-blocks), or where it is left out the largest divisor
    of the model's `n_layer` blocks up to ZERO3_UNIT_BLOCKS (4 for every GPT-2 size; 2 for gpt2-tiny)."""
    if fetch not in LEAF_FETCHES:
        return 1
    return given if given is not None else largest_divisor_up_to(n_layer, ZERO3_UNIT_BLOCKS)


def fsdp2_unit_blocks_of(flat: bool, given: int | None, n_layer: int) -> int:
    """Transformer blocks per FSDP2 unit: `given` (--fsdp2-unit-blocks), at most the model's `n_layer` blocks (a value
    given above it is refused by gpt2.config.cli); left out, FSDP2_UNIT_BLOCKS capped at `n_layer`, or over `flat`
    tensors (one flat layout for every unit) the largest divisor of `n_layer` up to it (4 for every GPT-2 size)."""
    if given is not None:
        return min(given, n_layer)
    if flat:
        return largest_divisor_up_to(n_layer, FSDP2_UNIT_BLOCKS)
    return min(FSDP2_UNIT_BLOCKS, n_layer)


DEEPCOMPILE_MIN_TORCH = (2, 6)  # deepspeed/compile/util.py is_deepcompile_supported (0.19.8)


def check_deepcompile_runs_here(device_type: str, torch_version: str = torch.__version__) -> None:
    """DeepCompile needs CUDA and torch >= 2.6: its native op (deepspeed/ops/csrc/compile) is CUDA C++ registered
    for the CUDA dispatch key only, and DeepSpeed registers its passes only where `is_deepcompile_supported()`
    (torch >= 2.6 and the cuda accelerator). On CPU `engine.compile()` fails building that op (cuda.h)."""
    if device_type != "cuda":
        raise ConfigError("--compiler deepcompile runs on CUDA only (DeepSpeed's DeepCompile op is CUDA C++); "
                          "run on a GPU, or use --compiler torch for a CPU run")
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    if (major, minor) < DEEPCOMPILE_MIN_TORCH:
        raise ConfigError(f"--compiler deepcompile needs torch >= 2.6 (DeepSpeed's is_deepcompile_supported), this "
                          f"is torch {torch_version}; upgrade torch or use --compiler torch")


def resolve_grad_accum(cfg: RunConfig, dp_size: int) -> int:
    """--grad-accum, or --global-batch-size / (--batch-size x dp-size), which must divide."""
    t = cfg.train
    if t.global_batch_size is None:
        return t.grad_accum
    per_step = t.batch_size * dp_size
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"--global-batch-size {t.global_batch_size} is not divisible by --batch-size "
            f"{t.batch_size} x dp-size {dp_size} = {per_step}; use a multiple of {per_step}")
    return t.global_batch_size // per_step


def inductor_compiles_head(cfg: RunConfig) -> bool:
    """Whether the whole model is one Inductor graph (`--compile-scope model`, DeepCompile), the LM head's
    cross-entropy included: `fused_kernels.fused_head_runs` decides whether --fused-kernels' chunked loss stays
    there, and the planner counts the compiled loss terms where it does not."""
    return compile_label(cfg.train.compile, cfg.train.compile_scope, cfg.train.compiler) in ("model", "deepcompile")


def torch_compiles_whole_model(cfg: RunConfig) -> bool:
    """Whether torch.compile traces the whole model as one graph (`--compile-scope model`): there Inductor's own
    fusion replaces a fused-kernel backend's elementwise ops where it ran faster (`fused_kernels.get_ops`,
    docs/decisions.md)."""
    return compile_label(cfg.train.compile, cfg.train.compile_scope, cfg.train.compiler) == "model"


def whole_mlp_allowed(cfg: RunConfig) -> bool:
    """A fused-kernel backend may run each MLP as one op reading both Linears' weights (`fused_kernels.KernelOps.mlp`):
    only where the Linears stay whole modules (no TP shards, no ZeRO-3 partitions), in compiled runs (eager, the op
    lost to the separate ones) and in per-block graphs: in a whole-model graph cuBLAS and Inductor's fusion ran the
    MLP faster end to end (docs/decisions.md)."""
    return (cfg.parallel.tp_size == 1 and cfg.zero_stage != 3 and cfg.train.compile
            and not torch_compiles_whole_model(cfg))


@dataclass(frozen=True)
class RunLayout:
    """One run's resolved layout. Build it with `RunLayout.resolve`; `cfg` is the parsed config, read-only."""

    cfg: RunConfig
    world_size: int
    device_type: str  # "cuda" or "cpu": decides the precision that runs
    grad_accum: int
    # --mode hybrid under DeepSpeed: the DeepSpeed file, read and checked against the flags once
    # (gpt2.config.deepspeed_file, which also builds DeepSpeed's config from it); the planner reads its ZeRO
    # settings. None for other modes and for --zero-engine fsdp2.
    ds_file: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def resolve(cls, cfg: RunConfig, world_size: int, device: torch.device | str) -> RunLayout:
        """Every check that needs the world size, in launch order: the mode vs the process count, tp x dp = world,
        --global-batch-size, the model shapes and the sequence split vs --tp-size, DeepCompile vs the device, and a
        hybrid run's DeepSpeed file against the flags."""
        t, p = cfg.train, cfg.parallel
        if t.mode == "single" and world_size > 1:
            raise ConfigError(f"--mode single was launched on {world_size} processes; "
                              "use --mode baseline (DDP) or launch one process")
        check_tp_divides_world(world_size, p.tp_size)
        grad_accum = resolve_grad_accum(cfg, dp_size_of(world_size, p.tp_size))
        check_tp_divides_model(cfg.model, p.tp_size)
        check_sequence_split(t.seq_len, p.tp_size, p.sequence_parallel)
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        if t.compile and t.compiler == "deepcompile":
            check_deepcompile_runs_here(device_type)
        layout = cls(cfg=cfg, world_size=world_size, device_type=device_type, grad_accum=grad_accum)
        if t.mode != "hybrid" or layout.fsdp2:  # FSDP2 reads no DeepSpeed file (cli refuses --ds-config with it)
            return layout
        return replace(layout, ds_file=read_ds_file(cfg, grad_accum, layout.dp_size, layout.deepcompile))

    # ------------------------------------------------------------ parallel sizes
    @property
    def mode(self) -> str:
        return self.cfg.train.mode

    @property
    def tp_size(self) -> int:
        return self.cfg.parallel.tp_size

    @property
    def dp_size(self) -> int:
        return dp_size_of(self.world_size, self.tp_size)

    @property
    def sequence_parallel(self) -> bool:
        return self.cfg.parallel.sequence_parallel

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return self.dp_size * t.batch_size * self.grad_accum * t.seq_len

    # ------------------------------------------------------------ precision
    @property
    def precision(self) -> str:
        return run_precision(self.cfg.train.precision, self.device_type)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None for fp32."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    # ------------------------------------------------------------ compile, TP comm counting
    @property
    def compile_scope(self) -> str:
        """"off", "blocks", "model" (--compile-scope as resolved by gpt2.config.schema) or "deepcompile" (DeepSpeed
        compiles the whole model in `gpt2.engines.deepspeed_engine`; nothing is compiled before
        `deepspeed.initialize`)."""
        t = self.cfg.train
        return compile_label(t.compile, t.compile_scope, t.compiler)

    @property
    def compile_wrapper(self) -> str | None:
        """How Inductor launches each compiled graph's kernels, --compile-wrapper resolved: "cpp" or "python"; None
        where torch.compile compiles nothing (no --compile, DeepCompile). `auto` picks C++ where GPU runs found it
        faster and passing parity (docs/decisions.md): the ZeRO-3 engines' per-block graphs on CUDA (DeepSpeed's
        and FSDP2's, not ZeRO-1/2), whose small-batch steps are host-bound, so each kernel launch's host time
        counts; with TP in them (its all-reduces in the graphs); and with `--fused-kernels cuda` (its bias+GELU
        custom op in the graphs) for DeepSpeed ZeRO-3 without TP, where kernels and no kernels must launch alike
        for the two to compare. Not yet with sequence parallelism (other collectives in the graphs), with the cuda
        kernels under TP or FSDP2, or with the Triton kernels, none of which has run with it on a GPU, nor for
        single/DDP's whole-model graph (not timed like for like). CPU runs keep Python: their kernels, not their
        launches, take the time, and the C++ build would lengthen every compiled CPU test."""
        t = self.cfg.train
        if self.compile_scope not in ("blocks", "model"):
            return None
        if t.compile_wrapper != "auto":
            return t.compile_wrapper
        zero3_graphs = self.zero3_blocks or (self.fsdp2 and self.zero_stage == 3)  # what ran with it on GPUs
        kernels_ran_with_it = t.fused_kernels == "none" or (
            t.fused_kernels == "cuda" and self.zero3_blocks and self.tp_size == 1)
        measured = (self.device_type == "cuda" and zero3_graphs and self.compile_scope == "blocks"
                    and not self.sequence_parallel and kernels_ran_with_it)
        return "cpp" if measured else "python"

    @property
    def inductor_cpp_wrapper(self) -> bool:
        """Whether the compiled graphs launch their kernels from C++ (`compile_wrapper`)."""
        return self.compile_wrapper == "cpp"

    @property
    def deepcompile(self) -> bool:
        """ZeRO-3 under DeepSpeed's DeepCompile (--compile --compiler deepcompile; gpt2.config.schema allows it only
        there):
        the ds config's compile.deepcompile, and `engine.compile()` after `deepspeed.initialize`."""
        return self.compile_scope == "deepcompile"

    @property
    def counts_tp_comm(self) -> bool:
        """Whether our TP collectives' bytes are counted (CommStats): with TP, and not under --compile (a Python
        counter inside the compiled graphs would break them at every collective)."""
        return self.tp_size > 1 and not self.cfg.train.compile

    @property
    def whole_mlp(self) -> bool:
        return whole_mlp_allowed(self.cfg)

    # ------------------------------------------------------------ ZeRO / DeepSpeed
    @property
    def zero_stage(self) -> int | None:
        """The DeepSpeed ZeRO stage; None unless --mode hybrid."""
        return self.cfg.zero_stage

    @property
    def zero_engine(self) -> str | None:
        """Who shards a hybrid run: "deepspeed" or "fsdp2" (--zero-engine); None unless --mode hybrid."""
        return self.cfg.zero_engine

    @property
    def triton_adamw(self) -> bool:
        """`--optimizer triton` (or auto under `--fused-kernels triton` or `cuda`): the update by
        `fused_kernels.triton.adamw` over torch's AdamW state, and its norm where the engine's norm is a plain one (no
        TP, no FSDP2), instead of torch's fused AdamW. Single, DDP and FSDP2 only
        (`gpt2.config.cli.resolve_optimizer`): DeepSpeed steps its own flat partitions."""
        return self.cfg.train.optimizer == "triton"

    @property
    def fsdp2(self) -> bool:
        """A hybrid run sharded by PyTorch FSDP2 (gpt2.engines.fsdp2_engine) instead of DeepSpeed."""
        return self.zero_engine == "fsdp2"

    @property
    def fsdp2_unit_blocks(self) -> int:
        """Transformer blocks per FSDP2 unit (fsdp2_unit_blocks_of)."""
        p = self.cfg.parallel
        return fsdp2_unit_blocks_of(p.fsdp2_params == "flat", p.fsdp2_unit_blocks, self.cfg.model.n_layer)

    @property
    def fsdp2_gather(self) -> str | None:
        """The dtype FSDP2 all-gathers the transformer blocks' weights in, --fsdp2-gather resolved: "bf16" or "fp32";
        None unless --zero-engine fsdp2. bf16 hands every Linear the values autocast would cast its fp32 weight to
        (the matmuls are unchanged) and rounds the blocks' LayerNorm scales and biases and their gradients to bf16
        (LayerNorm still computes in fp32; under TP the row-parallel bias is added in bf16): the differences from
        single's recipe, within the GPU parity gate; half the all-gather bytes and no autocast weight copies.
        `auto` picks it for bf16 runs without fused kernels (the configurations the GPU parity gate covered with
        it: docs/decisions.md); fp32 runs (every CPU run) gather fp32."""
        if not self.fsdp2:
            return None
        if self.precision != "bf16":
            return "fp32"
        choice = self.cfg.parallel.fsdp2_gather
        if choice == "auto":
            return "bf16" if self.cfg.train.fused_kernels == "none" else "fp32"
        return choice

    @property
    def fsdp2_gather_dtype(self) -> torch.dtype | None:
        """`fsdp2_gather` as FSDP2's `param_dtype`: bf16, or None (the weights' own fp32)."""
        return torch.bfloat16 if self.fsdp2_gather == "bf16" else None

    @property
    def zero3_fetch(self) -> str | None:
        """What DeepSpeed ZeRO-3's module hooks gather at once (--zero3-fetch); None where no such hooks gather: other
        stages, DeepCompile (which removes them and gathers every parameter inside its graph) and FSDP2 (which
        groups blocks into units itself, --fsdp2-unit-blocks)."""
        return (self.cfg.parallel.zero3_fetch if self.zero_stage == 3 and not self.deepcompile and not self.fsdp2
                else None)

    @property
    def zero3_blocks(self) -> bool:
        """ZeRO-3 gathering each transformer block as one DeepSpeed leaf module (--zero3-fetch block or flat)."""
        return self.zero3_fetch in LEAF_FETCHES

    @property
    def zero3_unit_blocks(self) -> int:
        """Transformer blocks per DeepSpeed leaf module (zero3_unit_blocks_of); 1 unless zero3_blocks."""
        return zero3_unit_blocks_of(self.zero3_fetch, self.cfg.parallel.zero3_unit_blocks, self.cfg.model.n_layer)

    @property
    def block_unit_blocks(self) -> int:
        """Transformer blocks per entry of `model.blocks`: a `gpt2.runtime.block_units.BlockUnit` where above 1, one
        module with one set of the ZeRO engine's hooks and, under --compile, one compiled graph a pass. FSDP2's
        unit (fsdp2_unit_blocks) or DeepSpeed's leaf unit (zero3_unit_blocks); 1 elsewhere."""
        return self.fsdp2_unit_blocks if self.fsdp2 else self.zero3_unit_blocks

    @property
    def checkpoints_in_units(self) -> bool:
        """Whether --activation-checkpointing recomputes each block on its own inside its BlockUnit (FSDP2's units:
        backward holds one block's activations at a time, as before FSDP2's units were modules; inside a compiled
        unit the checkpoints are traced into its graph) instead of GPT.forward checkpointing each unit whole
        (DeepSpeed's leaf units, and FSDP2's over flat tensors: a block recomputed in backward would run outside its
        unit's functional_call over the flat tensors' views, on parameters that are not there)."""
        return (self.cfg.train.activation_checkpointing and self.fsdp2 and not self.fsdp2_flat
                and self.block_unit_blocks > 1)

    @property
    def checkpointed_blocks(self) -> int:
        """Transformer blocks per --activation-checkpointing segment: each entry of `model.blocks` (a block, or a
        unit GPT.forward checkpoints whole), or one block where the units checkpoint their blocks themselves."""
        return 1 if self.checkpoints_in_units else self.block_unit_blocks

    @property
    def zero3_flat(self) -> bool:
        """ZeRO-3 leaf blocks whose parameters are a few flat tensors (--zero3-fetch flat, gpt2.runtime.flat_blocks);
        the model is then built whole, not under zero.Init."""
        return self.zero3_blocks and self.cfg.parallel.zero3_fetch == "flat"

    @property
    def fsdp2_flat(self) -> bool:
        """FSDP2 units whose parameters are a few flat tensors (--fsdp2-params flat, gpt2.runtime.flat_blocks)."""
        return self.fsdp2 and self.cfg.parallel.fsdp2_params == "flat"

    @property
    def flat_params(self) -> bool:
        """Each entry of `model.blocks` keeps its parameters in flat tensors (a FlatBlock): the ZeRO engine's
        --zero3-fetch flat or --fsdp2-params flat."""
        return self.zero3_flat or self.fsdp2_flat

    @property
    def ds_config_path(self) -> Path:
        return ds_config_file(self.cfg.parallel)

    # ------------------------------------------------------------ warnings
    def warnings(self, start_step: int) -> list[str]:
        """Settings that run but may not do what the user expects, for the loop to log: they need the layout and
        the step this launch starts from (a resumed run trains fewer steps)."""
        t, out = self.cfg.train, []
        steps = t.max_steps - start_step
        if steps <= t.untimed_steps:
            profiled = f" or profiled ({PROFILED_STEPS} after --throughput-warmup-steps)" if t.profile else ""
            out.append(f"all {steps} steps are throughput warm-up{profiled}: no tokens/s or MFU; raise --max-steps "
                       f"above {start_step + t.untimed_steps}")
        if self.cfg.model.dropout > 0 and self.tp_size > 1:  # no Megatron-style per-TP-rank RNG tracker here
            out.append(f"--dropout {self.cfg.model.dropout:g} with --tp-size {self.tp_size}: every rank draws from one "
                       "RNG stream, so dropout masks repeat across TP ranks' heads (and sequence shards with SP): "
                       "correlated, unlike single's; training stays consistent across ranks but is not the same "
                       "function as --mode single")
        if self.deepcompile and t.throughput_warmup_steps <= DEEPCOMPILE_RECOMPILE_STEP < steps:
            out.append(f"--throughput-warmup-steps {t.throughput_warmup_steps}: tokens/s and MFU count DeepCompile's "
                       f"second compile (after step {DEEPCOMPILE_RECOMPILE_STEP}, minutes on a large model); use "
                       f"--throughput-warmup-steps {DEEPCOMPILE_RECOMPILE_STEP + 1} or more for its trained speed")
        if t.warmup_steps > t.max_steps:
            out.append(f"--warmup-steps {t.warmup_steps} exceeds --max-steps {t.max_steps}: the LR never reaches "
                       f"--lr {t.lr:g}")
        return out

    # ------------------------------------------------------------ records
    def config_record(self, resumed_from: str | None = None) -> dict[str, Any]:
        """The parsed config as written to config.json and wandb, with the resolved gradient accumulation and
        the checkpoint folder this run resumed from."""
        record = self.cfg.to_dict()
        record["train"]["grad_accum"] = self.grad_accum
        record["checkpoint"]["resumed_from"] = resumed_from
        return record
