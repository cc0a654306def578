"""The run's configuration, declared once: GPT-2 presets and typed dataclasses whose fields carry their default and
their command-line flag (help, parser, group).

`gpt2.config.cli` builds train.py's parser from these fields and turns argv into a `RunConfig`, checking what needs
nothing else; what also needs the launch (world size, device) is decided once by `gpt2.config.layout.RunLayout`.
The parsed config is never mutated.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

GPT2_VOCAB_SIZE = 50257
VOCAB_PAD_MULTIPLE = 128  # 50257 -> 50304: tensor-core friendly LM-head GEMMs
MAX_LAYERS = 10_000  # --n-layer's bound (gpt2.config.cli.validate)


class ConfigError(ValueError):
    """A user-facing configuration error; the message says how to fix it."""


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def finite_float(text: str) -> float:
    """Every float flag: nan and inf parse as floats, and each either trains to NaN or silently turns a check off."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


@dataclass(frozen=True)
class Flag:
    """How one config field appears on train.py's command line (`gpt2.config.cli` builds the parser from these)."""

    help: str
    group: str
    names: tuple[str, ...] = ()  # default: --field-name
    parse: Callable[[str], Any] | None = None  # parses and checks one value; default: the field's type (finite floats)
    choices: tuple[Any, ...] | None = None  # default: a Literal field's values
    nargs: str | None = None
    metavar: str | None = None
    # the parser's default is None, so the CLI can tell "not given" from the default (a rule depends on it, or the
    # value is derived); `default_text` then says in --help what applies when the flag is left out
    given_only: bool = False
    default_text: str | None = None


def option(default: Any, help: str, group: str, **flag: Any) -> Any:
    """A config field with its default and its flag: the one place either is written."""
    meta = {"flag": Flag(help=help, group=group, **flag)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> Flag | None:
    """The field's flag; None for a field the command line does not set."""
    return f.metadata.get("flag")


MODEL_PRESETS: dict[str, dict[str, int]] = {
    "gpt2-tiny": dict(n_layer=2, n_head=4, n_embd=64, n_positions=256),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

MODEL = "mode and model"
DATA = "data"
OPTIM = "optimisation"
KERNELS = "kernels"
PARALLEL = "parallelism"
CHECKPOINTS = "checkpoints"
LOGGING = "logging"
PLANNING = "planning (gpt2.planning.planner; no GPU, data or launcher needed)"
GROUPS = (MODEL, DATA, OPTIM, KERNELS, PARALLEL, CHECKPOINTS, LOGGING, PLANNING)  # --help's order


@dataclass
class ModelConfig:
    n_layer: int = option(12, "override the preset's layer count", MODEL, parse=positive_int, given_only=True,
                          default_text="the --model preset's")
    n_head: int = option(12, "override the preset's head count", MODEL, parse=positive_int, given_only=True,
                         default_text="the --model preset's")
    n_embd: int = option(768, "override the preset's width", MODEL, parse=positive_int, given_only=True,
                         default_text="the --model preset's")
    n_positions: int = 1024  # learned position table size (GPT-2: 1024)
    vocab_size: int = GPT2_VOCAB_SIZE
    # pad the embedding/LM head to a multiple of 128; padded logits are masked
    pad_vocab: bool = option(True, "keep vocab at 50257 (no padding to 128)", MODEL, names=("--no-pad-vocab",))
    dropout: float = option(0.0, "dropout probability (attention, residual, embeddings)", MODEL)
    layer_norm_eps: float = 1e-5

    @property
    def padded_vocab_size(self) -> int:
        if not self.pad_vocab:
            return self.vocab_size
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


Mode = Literal["single", "baseline", "hybrid"]
PrecisionName = Literal["bf16", "fp16", "fp32"]
# --attn (fused_kernels.attention.ATTN_CHOICES; written out here so the config never imports torch kernels)
AttnChoice = Literal["sdpa", "auto", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flash"]


@dataclass
class DataConfig:
    data: Literal["wikitext", "synthetic"] = option(
        "wikitext", "wikitext: WikiText-103 via `datasets` (or --data-path); synthetic: random tokens", DATA)
    data_path: str | None = option(None, "text file(s) or a folder with train/validation files", DATA)
    # given-only: with --data synthetic, the tokenising flags are an error (gpt2.config.cli.check_flags_act)
    tokenizer: str = option("gpt2", "hub name, tokenizer.json or tokenizer folder", DATA, given_only=True)
    max_samples: int | None = option(None, "cap on training sequences", DATA, parse=positive_int)
    cache_dir: str = option(".cache/tokens", "tokenised-stream cache", DATA, given_only=True)
    num_proc: int = option(4, "tokenisation processes", DATA, parse=positive_int, given_only=True)
    eval_batches: int = option(20, "validation batches per evaluation; 0: no evaluation (throughput runs)", DATA,
                               parse=non_negative_int)


# ZeRO-3's default unit (--zero3-unit-blocks left out; --zero3-fetch flat is the default): 4 blocks a leaf module.
# DeepSpeed's host work is per unit, so fewer units step faster; the gain shrinks with each doubling, and a unit's
# gathered weights stay resident while it runs, so larger units buy little (docs/decisions.md).
ZERO3_UNIT_BLOCKS = 4
# FSDP2's default unit (--fsdp2-unit-blocks left out), for the same reason (docs/decisions.md)
FSDP2_UNIT_BLOCKS = 4


def unit_divisors(n_layer: int) -> list[int]:
    """The unit sizes that split a model's `n_layer` blocks into units of one size."""
    return [n for n in range(1, n_layer + 1) if n_layer % n == 0]


@dataclass
class ParallelConfig:
    tp_size: int = option(1, "tensor-parallel group size (divides the world size)", PARALLEL, parse=positive_int)
    sequence_parallel: bool = option(False, "shard LayerNorm/dropout regions along the sequence (all-gather/"
                                            "reduce-scatter instead of all-reduce; needs --tp-size > 1)", PARALLEL)
    tp_overlap: bool = option(True, "turn off the async input-gradient collective overlapped with the weight-gradient "
                                    "GEMM (eager runs; under --compile the TP collectives are traced synchronously)",
                              PARALLEL, names=("--no-tp-overlap",))
    zero_stage: Literal[1, 2, 3] = option(3, "hybrid mode: DeepSpeed ZeRO stage (--zero-engine fsdp2: 3 or 2)",
                                          PARALLEL, given_only=True)
    # who shards under --mode hybrid (gpt2.engines.fsdp2_engine says how FSDP2 maps the stages)
    zero_engine: Literal["deepspeed", "fsdp2"] = option(
        "deepspeed", "hybrid mode: the ZeRO implementation: deepspeed = DeepSpeed ZeRO-1/2/3 (--ds-config); fsdp2 = "
                     "PyTorch FSDP2 (fully_shard of groups of transformer blocks and of the embedding/head over the "
                     "data-parallel ranks; --zero-stage 3: parameters resharded after forward, 2: kept gathered from "
                     "forward to backward; no stage 1)", PARALLEL, given_only=True)
    # FSDP2's unit: the blocks one module (a BlockUnit) and one `fully_shard` call group (one all-gather, one
    # reduce-scatter, one set of hooks and under --compile one graph per unit and pass; gpt2.engines.fsdp2_engine)
    # left out: gpt2.config.layout.fsdp2_unit_blocks_of (FSDP2_UNIT_BLOCKS; over flat tensors, where it divides)
    fsdp2_unit_blocks: int | None = option(
        None, "--zero-engine fsdp2: transformer blocks per FSDP2 unit (one all-gather, reduce-scatter, hook set and, "
              "under --compile, compiled graph per unit: fewer, larger units cost less host time and hold more "
              "gathered weights; under --fsdp2-params flat it must divide the model's blocks)", PARALLEL,
        parse=positive_int, given_only=True,
        default_text=f"{FSDP2_UNIT_BLOCKS}, at most the model's blocks; under --fsdp2-params flat the largest divisor "
                     f"of the model's blocks up to {FSDP2_UNIT_BLOCKS}")
    # the dtype FSDP2 gathers the blocks' weights in (gpt2.config.layout.RunLayout.fsdp2_gather_dtype resolves auto)
    fsdp2_gather: Literal["auto", "bf16", "fp32"] = option(
        "auto", "--zero-engine fsdp2: the dtype the transformer blocks' weights are all-gathered in: bf16 = the "
                "values autocast hands the matmuls (half the bytes; LayerNorm scales, biases and their gradients "
                "rounded to bf16), fp32 = single's recipe to the bit; the embeddings/head always fp32, gradients "
                "reduced in fp32; auto = bf16 for bf16 runs without --fused-kernels (where it passed the parity gate "
                "on GPUs)", PARALLEL,
        given_only=True)
    # how many block units FSDP2 all-gathers ahead in forward (gpt2.engines.fsdp2_engine.set_forward_prefetch)
    fsdp2_forward_prefetch: int = option(
        0, "--zero-engine fsdp2: block units all-gathered ahead of the one running in forward (0 = FSDP2's default: "
           "each unit's all-gather issued by its own pre-forward hook; N: the next N units' issued when a unit's "
           "forward starts, holding N more units gathered; backward always prefetches one unit)", PARALLEL,
        parse=non_negative_int, given_only=True)
    # FSDP2's per-parameter host work (a DTensor, hooks and copies per tensor) over 3-4 flat tensors a unit instead of
    # 12 a block: gpt2.runtime.flat_blocks, which DeepSpeed's --zero3-fetch flat uses too (docs/decisions.md)
    fsdp2_params: Literal["tensors", "flat"] = option(
        "flat", "--zero-engine fsdp2: what FSDP2 shards: flat = each unit's parameters in 3-4 flat tensors (less "
                "host work a step; the units must divide the model's blocks; checkpoints hold the flat tensors and "
                "depend on --fsdp2-unit-blocks, export restores the names); tensors = each parameter on its own "
                "(FSDP2's way; checkpoints under the blocks' own names, at any unit size)", PARALLEL,
        given_only=True)
    # left out: gpt2.config.layout.zero3_unit_blocks_of (ZERO3_UNIT_BLOCKS, where it divides the blocks)
    zero3_unit_blocks: int | None = option(
        None, "hybrid mode, ZeRO-3 with --zero3-fetch block or flat: transformer blocks per DeepSpeed leaf module (one "
              "hook set and one gather per unit and pass; must divide the model's blocks)", PARALLEL,
        parse=positive_int, given_only=True,
        default_text=f"{ZERO3_UNIT_BLOCKS}, or the largest divisor of the model's blocks below it")
    zero3_fetch: Literal["block", "flat", "module"] = option(
        "flat", "hybrid mode, ZeRO-3: the parameter gather unit: flat = each unit of transformer blocks "
                "(--zero3-unit-blocks) is a DeepSpeed leaf module whose blocks keep their 12 parameters in 3-4 flat "
                "tensors (one all-gather and one hook set per unit and pass, the least per-tensor host work for "
                "DeepSpeed; the model is built whole before DeepSpeed partitions it; checkpoints hold the flat "
                "tensors, export restores the names); block = the same units over the blocks' own parameters "
                "(built under zero.Init); module = DeepSpeed's default hooks on every module (no --compile)",
        PARALLEL, given_only=True)
    # bf16/fp16 under DeepSpeed: torch.autocast over fp32 weights (the function every other mode trains), or
    # DeepSpeed's own 16-bit model with fp32 master weights (less memory and traffic, another rounding)
    zero_precision: Literal["autocast", "deepspeed"] = option(
        "autocast", "hybrid mode, bf16/fp16: autocast = torch.autocast over fp32 weights, the recipe of single and "
                    "DDP (DeepSpeed's torch_autocast section; Linear weights and gradients travel in 16 bits); "
                    "deepspeed = DeepSpeed's bf16/fp16 section: a 16-bit model with fp32 master weights, less "
                    "memory, but a different function (it fails the loss-parity check)", PARALLEL, given_only=True)
    ds_config: str | None = option(None, "DeepSpeed JSON config (hybrid mode)", PARALLEL,
                                   default_text="gpt2/config/ds_configs/zero{--zero-stage}.json")
    comm_log: bool = option(False, "hybrid mode: enable DeepSpeed's comms logger and put the measured ZeRO bytes per "
                                   "step next to the planner's prediction in the summary; it synchronises after every "
                                   "collective, which removes communication/compute overlap: not for throughput runs",
                            PARALLEL)
    deepspeed_nvtx: bool = option(False, "hybrid mode: keep DeepSpeed's NVTX ranges around its ZeRO functions (for an "
                                         "Nsight Systems timeline); off by default: thousands of ranges a ZeRO-3 "
                                         "step, each a host call", PARALLEL)


@dataclass
class CheckpointConfig:
    save_dir: str | None = option(None, "folder of step-XXXXXX checkpoints (enables saving)", CHECKPOINTS)
    save_interval: int = option(0, "save every N steps as well as at the end (0: only at the end)", CHECKPOINTS,
                                parse=non_negative_int)
    resume: str | None = option(None, "auto (latest checkpoint in --save-dir, if any) | a step folder | a save dir",
                                CHECKPOINTS)
    keep_last: int | None = option(None, "keep only the newest K checkpoints", CHECKPOINTS, parse=positive_int)


@dataclass
class LogConfig:
    out_dir: str = option("runs", "parent folder of run folders", LOGGING)
    run_name: str | None = option(None, "run folder name", LOGGING, default_text="mode-model-timestamp")
    wandb: Literal["online", "offline", "disabled"] | None = option(
        None, "Weights & Biases mode", LOGGING, default_text="online with credentials, else offline")
    wandb_project: str = option("gpt2-hybrid-parallel", "Weights & Biases project", LOGGING)
    wandb_group: str | None = option(None, "Weights & Biases group", LOGGING)
    wandb_tags: list[str] = option([], "Weights & Biases tags", LOGGING, nargs="*")
    log_interval: int = option(10, "log metrics every N steps", LOGGING, parse=positive_int)
    peak_tflops: float | None = option(None, "device peak dense TFLOP/s for MFU (overrides the table)", LOGGING,
                                       parse=positive_float)


THROUGHPUT_WARMUP_STEPS = 3
# DeepCompile compiles at the first step, profiles, then re-compiles with its prefetch and selective-gather passes
# in the step after this many (deepspeed/compile/init_z3.py WARMUP, DeepSpeed 0.19.8): the two compiles take minutes
# on GPT-2 Large (docs/decisions.md), which tokens/s must not count.
DEEPCOMPILE_RECOMPILE_STEP = 5
# --profile's window after the throughput warm-up: the profiler's warm-up step and its 3 recorded (active) steps;
# tokens/s and MFU leave them out (gpt2.observe.profiling)
PROFILED_STEPS = 4


@dataclass
class TrainConfig:
    mode: Mode = option("single", "single: one device; baseline: DDP; hybrid: ZeRO, DeepSpeed's or FSDP2's "
                                  "(--zero-engine; + --tp-size)", MODEL)
    model: str = option("gpt2-tiny", "GPT-2 preset", MODEL, choices=tuple(sorted(MODEL_PRESETS)))
    init_from: str | None = option(None, "gpt2 | gpt2-medium | gpt2-large | gpt2-xl | local HF folder", MODEL)
    batch_size: int = option(8, "micro-batch per data-parallel rank", OPTIM, parse=positive_int)
    grad_accum: int = option(1, "micro-steps per optimizer step", OPTIM, parse=positive_int, given_only=True)
    # if set, grad_accum is derived from it per world size (gpt2.config.layout)
    global_batch_size: int | None = option(
        None, "sequences per optimizer step; sets --grad-accum to it / (batch-size x dp-size)", OPTIM,
        parse=positive_int)
    seq_len: int = option(256, "tokens per sequence (<= the model's positions)", OPTIM, parse=positive_int)
    max_steps: int = option(50, "optimizer steps", OPTIM, parse=positive_int)
    warmup_steps: int = option(10, "LR warm-up steps (linear, then cosine to --min-lr)", OPTIM,
                               parse=non_negative_int)
    throughput_warmup_steps: int = option(
        THROUGHPUT_WARMUP_STEPS, "steps excluded from tokens/s and MFU", OPTIM, parse=non_negative_int,
        given_only=True, default_text=f"{THROUGHPUT_WARMUP_STEPS}; {DEEPCOMPILE_RECOMPILE_STEP + 1} under --compiler "
                                      f"deepcompile, whose second compile comes after step "
                                      f"{DEEPCOMPILE_RECOMPILE_STEP}")
    lr: float = option(6e-4, "peak learning rate (AdamW, fused)", OPTIM, parse=positive_float)
    min_lr: float = option(6e-5, "learning rate at the end of the cosine decay", OPTIM)
    weight_decay: float = option(0.1, "AdamW weight decay (not on biases, LayerNorms, embeddings)", OPTIM)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = option(1.0, "global gradient-norm clip; 0 disables clipping", OPTIM)
    max_bad_steps: int = option(
        3, "a step whose loss or gradient norm is not finite is skipped (nothing updated, nothing saved); this many "
           "in a row stop the run with exit code 65 (gpt2.engines.guard)", OPTIM, parse=positive_int)
    precision: PrecisionName = option("bf16", "autocast dtype on GPU; CPU runs always use fp32", OPTIM)
    seed: int = option(1337, "one seed for weights, data order and dropout", OPTIM)
    activation_checkpointing: bool = option(False, "recompute each block in backward (HFU counts the recomputation)",
                                            OPTIM)
    compile: bool = option(False, "torch.compile the model (see --compile-scope)", OPTIM)
    # the parsed config holds the resolved scope; the command line's `auto` picks one (gpt2.config.cli)
    compile_scope: Literal["blocks", "model"] = option(
        "blocks", "auto: model for single/baseline without TP (the fastest there), else blocks; blocks: each block + "
                  "LM head compiled separately (fast compile); model: the whole (DDP-wrapped) model as one graph, "
                  "split at DDP buckets (less per-step CPU overhead)", OPTIM, choices=("auto", "blocks", "model"),
        given_only=True, default_text="auto")
    # who compiles under --compile: torch.compile of our parts (--compile-scope), or DeepSpeed's DeepCompile
    # (engine.compile() with the ds config's compile.deepcompile: the whole model one graph, ZeRO-3's gathers and
    # gradient reduce-scatters inside it, scheduled by its prefetch and selective-gather passes)
    compiler: Literal["torch", "deepcompile"] = option(
        "torch", "with --compile: torch = torch.compile of the model's parts as --compile-scope says; deepcompile = "
                 "DeepSpeed's DeepCompile (--mode hybrid, ZeRO-3, CUDA, no TP): DeepSpeed compiles the whole model "
                 "as one graph with ZeRO-3's all-gathers and gradient reduce-scatters in it (its hooks removed), "
                 "prefetching and keeping parameters gathered as memory allows; same ZeRO-3 settings otherwise",
        OPTIM, given_only=True)
    # the code Inductor emits to run each compiled graph (gpt2.config.layout.RunLayout.compile_wrapper resolves auto)
    compile_wrapper: Literal["auto", "cpp", "python"] = option(
        "auto", "with --compile (--compiler torch): the host code Inductor generates to launch each graph's kernels: "
                "cpp = a compiled C++ wrapper (less host time per kernel, a longer first compile), python = Python; "
                "auto = cpp for ZeRO-3's per-block or per-unit graphs (DeepSpeed or FSDP2, with or without TP) on CUDA "
                "without sequence parallelism or fused kernels, and for DeepSpeed ZeRO-3's without TP under "
                "--fused-kernels cuda (where it ran faster), else python",
        OPTIM, given_only=True)
    ddp_bucket_mb: int = option(100, "DDP gradient bucket size (all-reduce granularity; --mode baseline)", OPTIM,
                                parse=positive_int, given_only=True)
    eval_interval: int = option(0, "evaluate every N steps; 0: at the end only (--eval-batches 0: never)", OPTIM,
                                parse=non_negative_int)
    fused_kernels: Literal["none", "triton", "cuda"] = option(
        "none", "fused-kernel backend (fused_kernels/); --use-fused-kernel is an alias of cuda", KERNELS)
    optimizer: Literal["auto", "torch", "triton"] = option(
        "auto", "AdamW's implementation, on the same state: torch = torch's fused AdamW; triton = "
                "fused_kernels/triton/adamw.py (the clipped update, and without TP or FSDP2 the norm, one launch each "
                "per parameter group; single, DDP and FSDP2); auto = triton under --fused-kernels triton or cuda "
                "where the engine keeps torch's AdamW state (not DeepSpeed's), else torch", KERNELS)
    attn: AttnChoice = option(
        "sdpa", "sdpa: PyTorch's SDPA picks its kernel; auto: on CUDA, the fastest SDPA kernel (flash, cuDNN, "
                "memory-efficient) at this run's shape that matches an fp64 reference, timed once at model build "
                "(CPU: sdpa); sdpa-flash|sdpa-cudnn|sdpa-efficient|sdpa-math: SDPA restricted to that kernel (an "
                "error where it cannot run); flash: the flash-attn package", KERNELS)
    device: str | None = option(None, "cpu | cuda", OPTIM, default_text="cuda when available")
    profile: bool = option(False, "profile 3 steps after the throughput warm-up: kernel table + Chrome trace in the "
                                  "run folder", OPTIM)

    @property
    def untimed_steps(self) -> int:
        """Steps of a run (from its start) that tokens/s and MFU leave out: the warm-up, then any profiled steps."""
        return self.throughput_warmup_steps + (PROFILED_STEPS if self.profile else 0)


@dataclass
class PlanConfig:
    """`--plan`: print the memory/communication plan (gpt2.planning.planner) and exit; with `--search`, rank layouts."""

    plan: bool = option(False, "print predicted memory and communication per GPU, then exit", PLANNING)
    search: bool = option(False, "with --plan: rank the layouts that fit by step time", PLANNING)
    gpus: int | None = option(None, "GPUs to plan for", PLANNING, names=("--gpus", "--world-size"),
                              parse=positive_int, default_text="$WORLD_SIZE or 1")
    gpu_memory_gib: float | None = option(None, "memory per GPU", PLANNING, parse=positive_float,
                                          default_text="the CUDA device's, else 80")
    busbw_gbs: list[float] = option([350.0, 40.0], "collective bus bandwidth within a node [and across nodes] for "
                                                   "--search", PLANNING, parse=positive_float, nargs="+",
                                    metavar="GB/S", given_only=True)
    achievable_tflops: float = option(400.0, "sustained TFLOP/s per GPU assumed by --search", PLANNING,
                                      parse=positive_float, given_only=True)


@dataclass
class RunConfig:
    train: TrainConfig
    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig
    log: LogConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    @property
    def zero_stage(self) -> int | None:
        """The DeepSpeed ZeRO stage the run trains with; None unless --mode hybrid. The one place that says whether
        a run is ZeRO-3: the config checks, RunLayout, the DeepSpeed config and the planner read it."""
        return self.parallel.zero_stage if self.train.mode == "hybrid" else None

    @property
    def zero_engine(self) -> str | None:
        """Who implements the ZeRO sharding (--zero-engine: deepspeed or fsdp2); None unless --mode hybrid."""
        return self.parallel.zero_engine if self.train.mode == "hybrid" else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def compile_label(enabled: bool, compile_scope: str, compiler: str = "torch") -> str:
    """What --compile does, as run records, reports and parity keys name it: off, blocks, model or deepcompile."""
    if not enabled:
        return "off"
    return "deepcompile" if compiler == "deepcompile" else compile_scope
