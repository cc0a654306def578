"""Typed configuration: GPT-2 presets, training, data, parallel layout and logging, plus the CLI.

The command line is the single source of truth. `parse_args()` turns argv into a `RunConfig`,
and `validate()` rejects bad input with an error that names the fix, before any heavy work. What also needs the
launch (world size, device) is decided once by `gpt2.layout.RunLayout`; the parsed config is never mutated.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

GPT2_VOCAB_SIZE = 50257
VOCAB_PAD_MULTIPLE = 128  # 50257 -> 50304: tensor-core friendly LM-head GEMMs
MAX_LAYERS = 10_000


class ConfigError(ValueError):
    """A user-facing configuration error; the message says how to fix it."""


@dataclass
class ModelConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_positions: int = 1024  # learned position table size (GPT-2: 1024)
    vocab_size: int = GPT2_VOCAB_SIZE
    pad_vocab: bool = True  # pad the embedding/LM head to a multiple of 128; padded logits are masked
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    @property
    def padded_vocab_size(self) -> int:
        if not self.pad_vocab:
            return self.vocab_size
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


MODEL_PRESETS: dict[str, dict[str, int]] = {
    "gpt2-tiny": dict(n_layer=2, n_head=4, n_embd=64, n_positions=256),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

Mode = Literal["single", "baseline", "hybrid"]
Precision = Literal["bf16", "fp16", "fp32"]
# --attn (fused_kernels.attention.ATTN_CHOICES; written out here so the config never imports torch kernels)
AttnChoice = Literal["sdpa", "auto", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flash"]


@dataclass
class DataConfig:
    data: str = "wikitext"  # "wikitext" (WikiText-103 via `datasets`) or "synthetic"
    data_path: str | None = None  # local text file(s) or a folder with train/validation files
    tokenizer: str = "gpt2"  # hub name, tokenizer.json path or tokenizer folder
    max_samples: int | None = None  # cap on training blocks
    cache_dir: str = ".cache/tokens"
    num_proc: int = 4  # tokenisation processes
    eval_batches: int = 20


@dataclass
class ParallelConfig:
    tp_size: int = 1
    sequence_parallel: bool = False
    tp_overlap: bool = True
    zero_stage: int = 3
    zero3_fetch: Literal["block", "module"] = "block"  # ZeRO-3 gather unit: a whole transformer block, or each module
    # bf16/fp16 under DeepSpeed: torch.autocast over fp32 weights (the function every other mode trains), or
    # DeepSpeed's own 16-bit model with fp32 master weights (less memory and traffic, another rounding)
    zero_precision: Literal["autocast", "deepspeed"] = "autocast"
    ds_config: str | None = None
    comm_log: bool = False  # DeepSpeed's comms logger (hybrid): measured ZeRO bytes per step in the summary
    deepspeed_nvtx: bool = False  # DeepSpeed's NVTX ranges around its ZeRO functions (for nsys; host time per call)


@dataclass
class CheckpointConfig:
    save_dir: str | None = None  # parent of step-XXXXXX folders; None: no checkpoints
    save_interval: int = 0  # also save every N steps (0: only at the end)
    resume: str | None = None  # "auto" (latest in save_dir, if any) or a step folder / save dir
    keep_last: int | None = None  # delete all but the newest K checkpoints


@dataclass
class LogConfig:
    out_dir: str = "runs"
    run_name: str | None = None
    wandb: Literal["online", "offline", "disabled"] | None = None  # None: online iff credentials
    wandb_project: str = "gpt2-hybrid-parallel"
    wandb_group: str | None = None
    wandb_tags: list[str] = field(default_factory=list)
    log_interval: int = 10
    peak_tflops: float | None = None


THROUGHPUT_WARMUP_STEPS = 3
# DeepCompile compiles at the first step, profiles, then re-compiles with its prefetch and selective-gather passes
# in the step after this many (deepspeed/compile/init_z3.py WARMUP, DeepSpeed 0.19.8): on GPT-2 Large on one H100
# the two compiles took over 8 minutes, which tokens/s must not count.
DEEPCOMPILE_RECOMPILE_STEP = 5


@dataclass
class TrainConfig:
    mode: Mode = "single"
    model: str = "gpt2-tiny"
    init_from: str | None = None
    batch_size: int = 8  # micro-batch per GPU (per data-parallel replica)
    grad_accum: int = 1
    global_batch_size: int | None = None  # if set, grad_accum is derived from it per world size
    seq_len: int = 256
    max_steps: int = 50
    warmup_steps: int = 10  # LR warm-up
    throughput_warmup_steps: int = THROUGHPUT_WARMUP_STEPS  # steps excluded from tokens/s and MFU
    lr: float = 6e-4
    min_lr: float = 6e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_bad_steps: int = 3  # consecutive non-finite steps (each skipped) that stop the run (gpt2.guard)
    precision: Precision = "bf16"
    seed: int = 1337
    activation_checkpointing: bool = False
    compile: bool = False
    compile_scope: Literal["blocks", "model"] = "blocks"  # per-block graphs, or one graph (DDP-bucketed)
    # who compiles under --compile: torch.compile of our parts (--compile-scope), or DeepSpeed's DeepCompile
    # (engine.compile() with the ds config's compile.deepcompile: the whole model one graph, ZeRO-3's gathers and
    # gradient reduce-scatters inside it, scheduled by its prefetch and selective-gather passes)
    compiler: Literal["torch", "deepcompile"] = "torch"
    ddp_bucket_mb: int = 100  # DDP gradient bucket size (all-reduce granularity)
    eval_interval: int = 0  # 0: evaluate only at the end
    fused_kernels: Literal["none", "triton", "cuda"] = "none"
    attn: AttnChoice = "sdpa"
    device: str | None = None  # None: cuda if available else cpu
    profile: bool = False  # torch.profiler over 3 steps after the throughput warm-up


@dataclass
class PlanConfig:
    """`--plan`: print the memory/communication plan (gpt2.planner) and exit; with `--search`, rank layouts."""

    plan: bool = False
    search: bool = False
    gpus: int | None = None  # GPUs to plan for; None: $WORLD_SIZE or 1
    gpu_memory_gib: float | None = None  # None: the CUDA device's memory, else 80
    busbw_gbs: list[float] = field(default_factory=lambda: [350.0, 40.0])  # within a node, across nodes
    achievable_tflops: float = 400.0


@dataclass
class RunConfig:
    train: TrainConfig
    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig
    log: LogConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _finite_float(text: str) -> float:
    """Every float flag: nan and inf parse as floats, and each either trains to NaN or silently turns a check off."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train GPT-2 with single-device, DDP or DeepSpeed ZeRO-3 (+ tensor parallel).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("mode and model")
    g.add_argument("--mode", choices=["single", "baseline", "hybrid"], default="single")
    g.add_argument("--model", choices=sorted(MODEL_PRESETS), default="gpt2-tiny")
    g.add_argument("--n-layer", type=_positive_int, help="override the preset's layer count")
    g.add_argument("--n-embd", type=_positive_int, help="override the preset's width")
    g.add_argument("--n-head", type=_positive_int, help="override the preset's head count")
    g.add_argument("--dropout", type=_finite_float, default=0.0)
    g.add_argument("--no-pad-vocab", action="store_true", help="keep vocab at 50257 (no padding to 128)")
    g.add_argument("--init-from", help="gpt2 | gpt2-medium | gpt2-large | gpt2-xl | local HF folder")

    g = p.add_argument_group("data")
    g.add_argument("--data", choices=["wikitext", "synthetic"], default="wikitext")
    g.add_argument("--data-path", help="text file(s) or a folder with train/validation files")
    g.add_argument("--tokenizer", help=f"hub name, tokenizer.json or tokenizer folder (default {DataConfig.tokenizer})")
    g.add_argument("--max-samples", type=_positive_int, help="cap on training sequences")
    g.add_argument("--cache-dir", help=f"tokenised-stream cache (default {DataConfig.cache_dir})")
    g.add_argument("--num-proc", type=_positive_int, help=f"tokenisation processes (default {DataConfig.num_proc})")
    g.add_argument("--eval-batches", type=_positive_int, default=20)

    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=_positive_int, default=8, help="micro-batch per data-parallel rank")
    g.add_argument("--grad-accum", type=_positive_int, help="micro-steps per optimizer step (default 1)")
    g.add_argument("--global-batch-size", type=_positive_int,
                   help="sequences per optimizer step; sets --grad-accum to it / (batch-size x dp-size)")
    g.add_argument("--seq-len", type=_positive_int, default=256)
    g.add_argument("--max-steps", type=_positive_int, default=50)
    g.add_argument("--warmup-steps", type=_non_negative_int, default=10)
    g.add_argument("--throughput-warmup-steps", type=_non_negative_int,
                   help=f"steps excluded from tokens/s and MFU (default {THROUGHPUT_WARMUP_STEPS}; "
                        f"{DEEPCOMPILE_RECOMPILE_STEP + 1} under --compiler deepcompile, whose second compile "
                        f"comes after step {DEEPCOMPILE_RECOMPILE_STEP})")
    g.add_argument("--lr", type=_positive_float, default=6e-4)
    g.add_argument("--min-lr", type=_finite_float, default=6e-5)
    g.add_argument("--weight-decay", type=_finite_float, default=0.1)
    g.add_argument("--grad-clip", type=_finite_float, default=1.0, help="0 disables clipping")
    g.add_argument("--max-bad-steps", type=_positive_int, default=3,
                   help="a step whose loss or gradient norm is not finite is skipped (nothing updated, nothing "
                        "saved); this many in a row stop the run with exit code 65")
    g.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="autocast dtype on GPU; CPU runs always use fp32")
    g.add_argument("--seed", type=int, default=1337)
    g.add_argument("--activation-checkpointing", action="store_true")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (see --compile-scope)")
    g.add_argument("--compile-scope", choices=["auto", "blocks", "model"], default="auto",
                   help="auto: model for single/baseline without TP (measured fastest), else blocks; "
                        "blocks: each block + LM head compiled separately (fast compile); model: the whole "
                        "(DDP-wrapped) model as one graph, split at DDP buckets (less per-step CPU overhead)")
    g.add_argument("--compiler", choices=["torch", "deepcompile"],
                   help="with --compile: torch (default) = torch.compile of the model's parts as --compile-scope says; "
                        "deepcompile = DeepSpeed's DeepCompile (--mode hybrid, ZeRO-3, CUDA, no TP): DeepSpeed "
                        "compiles the whole model as one graph with ZeRO-3's all-gathers and gradient "
                        "reduce-scatters in it (its hooks removed), prefetching and keeping parameters gathered as "
                        "memory allows; same ZeRO-3 settings otherwise")
    g.add_argument("--ddp-bucket-mb", type=_positive_int,
                   help=f"DDP gradient bucket size (--mode baseline; default {TrainConfig.ddp_bucket_mb})")
    g.add_argument("--eval-interval", type=_non_negative_int, default=0, help="0: evaluate at the end only")
    g.add_argument("--device", help="cpu | cuda (default: cuda when available)")
    g.add_argument("--profile", action="store_true",
                   help="profile 3 steps after the throughput warm-up: kernel table + Chrome trace in the run folder")

    g = p.add_argument_group("kernels")
    g.add_argument("--fused-kernels", choices=["none", "triton", "cuda"], default="none")
    g.add_argument("--use-fused-kernel", action="store_true", help="alias of --fused-kernels cuda")
    g.add_argument("--attn", choices=list(get_args(AttnChoice)), default="sdpa",
                   help="sdpa: PyTorch's SDPA picks its kernel; auto: on CUDA, the fastest SDPA kernel (flash, cuDNN, "
                        "memory-efficient) at this run's shape that matches an fp64 reference, timed once at model "
                        "build (CPU: sdpa); sdpa-flash|sdpa-cudnn|sdpa-efficient|sdpa-math: SDPA restricted to that "
                        "kernel (an error where it cannot run); flash: the flash-attn package")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tp-size", type=_positive_int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-tp-overlap", action="store_true")
    g.add_argument("--zero-stage", type=int, choices=[1, 2, 3], help="hybrid mode: DeepSpeed ZeRO stage (default 3)")
    g.add_argument("--zero3-fetch", choices=["block", "module"],
                   help="hybrid mode, ZeRO-3: the parameter gather unit (default block): block = each transformer "
                        "block is a DeepSpeed leaf module "
                        "(one all-gather and one hook per block and pass; allows --compile), module = DeepSpeed's "
                        "default hooks on every module")
    g.add_argument("--zero-precision", choices=["autocast", "deepspeed"],
                   help="hybrid mode, bf16/fp16: autocast (default) = torch.autocast over fp32 weights, the recipe of "
                        "single and DDP (DeepSpeed's torch_autocast section; Linear weights and gradients travel in "
                        "16 bits); deepspeed = DeepSpeed's bf16/fp16 section: a 16-bit model with fp32 master "
                        "weights, less memory, but a different function (it fails the loss-parity check)")
    g.add_argument("--ds-config", help="DeepSpeed JSON config (hybrid mode)")
    g.add_argument("--comm-log", action="store_true",
                   help="hybrid mode: enable DeepSpeed's comms logger and put the measured ZeRO bytes per step next "
                        "to the planner's prediction in the summary; it synchronises after every collective, "
                        "which removes communication/compute overlap: not for throughput runs")
    g.add_argument("--deepspeed-nvtx", action="store_true",
                   help="hybrid mode: keep DeepSpeed's NVTX ranges around its ZeRO functions (for an Nsight Systems "
                        "timeline); off by default: thousands of ranges a ZeRO-3 step, each a host call")
    # the `deepspeed` launcher appends --local_rank=N; the LOCAL_RANK environment variable is what we read
    g.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-dir", help="folder of step-XXXXXX checkpoints (enables saving)")
    g.add_argument("--save-interval", type=_non_negative_int, default=0,
                   help="save every N steps as well as at the end (0: only at the end)")
    g.add_argument("--resume", help="auto (latest checkpoint in --save-dir, if any) | a step folder | a save dir")
    g.add_argument("--keep-last", type=_positive_int, help="keep only the newest K checkpoints")

    g = p.add_argument_group("logging")
    g.add_argument("--out-dir", default="runs", help="parent folder of run folders")
    g.add_argument("--run-name", help="run folder name (default: mode-model-timestamp)")
    g.add_argument("--wandb", choices=["online", "offline", "disabled"],
                   help="default: online with credentials, else offline")
    g.add_argument("--wandb-project", default="gpt2-hybrid-parallel")
    g.add_argument("--wandb-group")
    g.add_argument("--wandb-tags", nargs="*", default=[])
    g.add_argument("--log-interval", type=_positive_int, default=10)
    g.add_argument("--peak-tflops", type=_positive_float,
                   help="device peak dense TFLOP/s for MFU (overrides the table)")

    g = p.add_argument_group("planning (gpt2.planner; no GPU, data or launcher needed)")
    g.add_argument("--plan", action="store_true", help="print predicted memory and communication per GPU, then exit")
    g.add_argument("--search", action="store_true", help="with --plan: rank the layouts that fit by step time")
    g.add_argument("--gpus", "--world-size", type=_positive_int, help="GPUs to plan for (default: $WORLD_SIZE or 1)")
    g.add_argument("--gpu-memory-gib", type=_positive_float,
                   help="memory per GPU (default: the CUDA device's, else 80)")
    g.add_argument("--busbw-gbs", type=_positive_float, nargs="+", metavar="GB/S",
                   help="collective bus bandwidth within a node [and across nodes] for --search (default "
                        f"{' '.join(f'{v:g}' for v in PlanConfig().busbw_gbs)})")
    g.add_argument("--achievable-tflops", type=_positive_float,
                   help=f"sustained TFLOP/s per GPU assumed by --search (default {PlanConfig.achievable_tflops:g})")
    return p


def throughput_warmup_default(deepcompile: bool) -> int:
    """Steps excluded from tokens/s and MFU when --throughput-warmup-steps is not given: under DeepCompile, every
    step up to its re-compile (DEEPCOMPILE_RECOMPILE_STEP), which are compile and profiling time."""
    return DEEPCOMPILE_RECOMPILE_STEP + 1 if deepcompile else THROUGHPUT_WARMUP_STEPS


def resolve_compile_scope(requested: str, mode: str, tp_size: int, compiler: str = "torch") -> str:
    """`auto`: one whole-model graph for single/DDP without TP (4xH200, GPT-2 Large: +21% tokens/s at batch 8
    over per-block graphs, benchmarks/results/train/), per-block graphs elsewhere (ZeRO hooks, TP collectives).
    DeepCompile always compiles the whole model (`engine.compile()`): `model`; it has no per-block scope."""
    if compiler == "deepcompile":
        if requested == "blocks":
            raise ConfigError("--compiler deepcompile compiles the whole model as one graph (DeepSpeed's "
                              "engine.compile()); drop --compile-scope blocks or use --compiler torch")
        return "model"
    if requested != "auto":
        return requested
    return "model" if mode in ("single", "baseline") and tp_size == 1 else "blocks"


def compile_label(enabled: bool, compile_scope: str, compiler: str = "torch") -> str:
    """What --compile does, as run records, reports and parity keys name it: off, blocks, model or deepcompile."""
    if not enabled:
        return "off"
    return "deepcompile" if compiler == "deepcompile" else compile_scope


def check_deepcompile(args: argparse.Namespace) -> None:
    """`--compiler deepcompile`: the combinations DeepSpeed's DeepCompile (0.19.8) cannot run, or this harness
    has not wired, each an error naming the fix. The CUDA and torch-version needs are `gpt2.layout`'s (device)."""
    if args.compiler != "deepcompile":
        return
    if not args.compile:
        raise ConfigError("--compiler deepcompile says how --compile compiles; add --compile")
    if args.mode != "hybrid":
        raise ConfigError("--compiler deepcompile is DeepSpeed's ZeRO compiler: use --mode hybrid (ZeRO-3), or "
                          "--compiler torch")
    if (args.zero_stage or ParallelConfig.zero_stage) != 3:
        raise ConfigError(f"--compiler deepcompile is wired for ZeRO-3 only (DeepSpeed's ZeRO-1/2 passes are not); "
                          f"use --zero-stage 3, or --compiler torch with --zero-stage {args.zero_stage}")
    if args.tp_size > 1:
        raise ConfigError("--compiler deepcompile is not wired with our tensor parallelism (a TP model is not built "
                          "under zero.Init, and Dynamo cannot capture the vocab-parallel head, gpt2.compiling); use "
                          "--tp-size 1, or --compiler torch")
    if args.zero3_fetch is not None:
        raise ConfigError("--compiler deepcompile removes ZeRO-3's gather hooks and gathers each parameter inside "
                          "the compiled graph, so there is no fetch unit to choose; drop --zero3-fetch")
    if args.comm_log:
        raise ConfigError("--comm-log reads DeepSpeed's comms logger, which DeepCompile's collectives (issued by its "
                          "C++ op on the process group) bypass; drop --comm-log or use --compiler torch")


def check_flags_act(args: argparse.Namespace) -> None:
    """A flag given to a run in which it cannot act is an error naming why (not silently recorded as if used)."""
    if args.gpus is not None and not args.plan:
        raise ConfigError(f"--gpus / --world-size {args.gpus}: the GPU count that --plan plans for; a training run's "
                          "size is its launcher's (torchrun --nproc_per_node=N, deepspeed --num_gpus=N): add --plan "
                          "or drop it")
    searching = [flag for flag, value in (("--busbw-gbs", args.busbw_gbs),
                                          ("--achievable-tflops", args.achievable_tflops)) if value is not None]
    if searching and not args.search:
        raise ConfigError(f"{', '.join(searching)}: read only by --plan --search (to rank layouts by step time); "
                          "add --plan --search or drop them")
    if args.compile_scope != "auto" and not args.compile:
        raise ConfigError(f"--compile-scope {args.compile_scope} says what --compile compiles; add --compile or drop "
                          "it")
    if args.compiler == "torch" and not args.compile:
        raise ConfigError("--compiler torch says who compiles under --compile; add --compile or drop it")
    if args.ddp_bucket_mb is not None and args.mode != "baseline":
        raise ConfigError(f"--ddp-bucket-mb sizes DDP's gradient buckets, used only by --mode baseline (--mode "
                          f"{args.mode} has no DDP); drop it")
    if args.mode == "hybrid" and args.zero3_fetch is not None and (args.zero_stage or ParallelConfig.zero_stage) != 3:
        raise ConfigError(f"--zero3-fetch chooses what ZeRO-3 gathers at once; --zero-stage {args.zero_stage} keeps "
                          "whole parameters on every rank and gathers nothing: drop it or use --zero-stage 3")
    if args.no_tp_overlap and args.tp_size == 1:
        raise ConfigError("--no-tp-overlap turns off the overlap of tensor-parallel collectives, and --tp-size 1 has "
                          "none; drop it or pass --tp-size > 1")
    tokenising = [flag for flag, value in (("--tokenizer", args.tokenizer), ("--cache-dir", args.cache_dir),
                                           ("--num-proc", args.num_proc)) if value is not None]
    if tokenising and args.data == "synthetic":
        raise ConfigError(f"{', '.join(tokenising)}: --data synthetic draws random token ids and tokenises nothing; "
                          "drop them or train on text (--data-path)")
    if args.init_from and args.resume not in (None, "auto"):
        raise ConfigError(f"--init-from {args.init_from} gives a new run its weights, but --resume {args.resume} "
                          "loads the checkpoint's over them; drop one (--resume auto with --init-from is fine: a "
                          "first launch starts from --init-from, a requeued one from its checkpoint)")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    check_deepcompile(args)
    check_flags_act(args)
    preset = dict(MODEL_PRESETS[args.model])
    for key in ("n_layer", "n_embd", "n_head"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    model = ModelConfig(**preset, dropout=args.dropout, pad_vocab=not args.no_pad_vocab)
    train = TrainConfig(
        mode=args.mode, model=args.model, init_from=args.init_from, batch_size=args.batch_size,
        grad_accum=args.grad_accum or 1, global_batch_size=args.global_batch_size,
        seq_len=args.seq_len, max_steps=args.max_steps,
        warmup_steps=args.warmup_steps,
        throughput_warmup_steps=(args.throughput_warmup_steps if args.throughput_warmup_steps is not None else
                                 throughput_warmup_default(
                                     compile_label(args.compile, "model", args.compiler or "torch") == "deepcompile")),
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        max_bad_steps=args.max_bad_steps,
        precision=args.precision, seed=args.seed,
        activation_checkpointing=args.activation_checkpointing, compile=args.compile,
        compile_scope=resolve_compile_scope(args.compile_scope, args.mode, args.tp_size, args.compiler or "torch"),
        compiler=args.compiler or TrainConfig.compiler,
        ddp_bucket_mb=args.ddp_bucket_mb or TrainConfig.ddp_bucket_mb,
        eval_interval=args.eval_interval,
        fused_kernels="cuda" if args.use_fused_kernel else args.fused_kernels,
        attn=args.attn, device=args.device, profile=args.profile,
    )
    if args.use_fused_kernel and args.fused_kernels not in ("none", "cuda"):
        raise ConfigError("--use-fused-kernel means --fused-kernels cuda; drop one of the two flags")
    if args.grad_accum is not None and args.global_batch_size is not None:
        raise ConfigError("--global-batch-size sets the accumulation steps itself; drop --grad-accum "
                          f"{args.grad_accum} or --global-batch-size {args.global_batch_size}")
    data = DataConfig(
        data=args.data, data_path=args.data_path, tokenizer=args.tokenizer or DataConfig.tokenizer,
        max_samples=args.max_samples, cache_dir=args.cache_dir or DataConfig.cache_dir,
        num_proc=args.num_proc or DataConfig.num_proc,
        eval_batches=args.eval_batches,
    )
    zero_flags = [flag for flag, value in (("--zero-stage", args.zero_stage), ("--zero3-fetch", args.zero3_fetch),
                                           ("--zero-precision", args.zero_precision),
                                           ("--deepspeed-nvtx", args.deepspeed_nvtx or None)) if value is not None]
    if zero_flags and args.mode != "hybrid":
        raise ConfigError(f"{' / '.join(zero_flags)}: DeepSpeed ZeRO settings, used only by --mode hybrid; "
                          f"drop {'it' if len(zero_flags) == 1 else 'them'} or use --mode hybrid")
    parallel = ParallelConfig(
        tp_size=args.tp_size, sequence_parallel=args.sequence_parallel, tp_overlap=not args.no_tp_overlap,
        zero_stage=args.zero_stage or ParallelConfig.zero_stage,
        zero3_fetch=args.zero3_fetch or ParallelConfig.zero3_fetch,
        zero_precision=args.zero_precision or ParallelConfig.zero_precision,
        ds_config=args.ds_config,
        comm_log=args.comm_log,
        deepspeed_nvtx=args.deepspeed_nvtx,
    )
    log = LogConfig(
        out_dir=args.out_dir, run_name=args.run_name, wandb=args.wandb,
        wandb_project=args.wandb_project, wandb_group=args.wandb_group,
        wandb_tags=list(args.wandb_tags), log_interval=args.log_interval,
        peak_tflops=args.peak_tflops,
    )
    checkpoint = CheckpointConfig(save_dir=args.save_dir, save_interval=args.save_interval, resume=args.resume,
                                  keep_last=args.keep_last)
    plan = PlanConfig(plan=args.plan, search=args.search, gpus=args.gpus, gpu_memory_gib=args.gpu_memory_gib,
                      busbw_gbs=list(args.busbw_gbs or PlanConfig().busbw_gbs),
                      achievable_tflops=args.achievable_tflops or PlanConfig.achievable_tflops)
    if len(plan.busbw_gbs) > 2:
        raise ConfigError(f"--busbw-gbs takes one or two values (within a node, across nodes), got "
                          f"{len(plan.busbw_gbs)}")
    if args.search and not args.plan:
        raise ConfigError("--search ranks layouts for --plan; add --plan")
    return RunConfig(train=train, model=model, data=data, parallel=parallel, log=log, checkpoint=checkpoint,
                     plan=plan)


def check_sequence_parallel(tp_size: int, sequence_parallel: bool) -> None:
    """Sequence parallelism shards the sequence over the tensor-parallel group: it needs tp_size > 1."""
    if sequence_parallel and tp_size == 1:
        raise ConfigError("--sequence-parallel shards the sequence over the tensor-parallel group; "
                          "pass --tp-size > 1 or drop --sequence-parallel")


def validate(cfg: RunConfig) -> None:
    """Checks that need no process group, no data and no GPU."""
    m, t = cfg.model, cfg.train
    if m.n_layer > MAX_LAYERS:
        raise ConfigError(f"--n-layer {m.n_layer}: at most {MAX_LAYERS:,} (ten times DeepNet's 1,000 layers, among "
                          "the deepest transformers trained); deeper plans only take memory and time")
    if m.n_embd % m.n_head:
        raise ConfigError(f"--n-embd {m.n_embd} is not divisible by --n-head {m.n_head}; "
                          f"pick a head count that divides {m.n_embd}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"--dropout must be in [0, 1), got {m.dropout}")
    if t.seq_len > m.n_positions:
        raise ConfigError(f"--seq-len {t.seq_len} exceeds the model's {m.n_positions} positions "
                          f"({t.model}); use --seq-len <= {m.n_positions}")
    if not 0.0 <= t.min_lr <= t.lr:
        raise ConfigError(f"--min-lr must be in [0, --lr {t.lr}], got {t.min_lr}")
    if t.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {t.weight_decay}")
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"--seed must be in [0, 2**32) (numpy's seed range), got {t.seed}")
    if t.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", t.device):
        raise ConfigError(f"--device {t.device!r} is not a device this harness runs on; use cpu or cuda")
    if t.grad_clip < 0:
        raise ConfigError(f"--grad-clip must be >= 0 (0 disables), got {t.grad_clip}")
    if cfg.data.data == "synthetic" and cfg.data.data_path:
        raise ConfigError("--data synthetic ignores --data-path; drop one of the two")
    if t.mode != "hybrid" and cfg.parallel.ds_config:
        raise ConfigError("--ds-config only applies to --mode hybrid")
    if t.mode != "hybrid" and cfg.parallel.comm_log:
        raise ConfigError("--comm-log only applies to --mode hybrid (DeepSpeed's comms logger)")
    if t.compile and t.mode == "hybrid" and cfg.parallel.zero_stage == 3 and cfg.parallel.zero3_fetch == "module":
        raise ConfigError("--compile with ZeRO-3 needs --zero3-fetch block (per-module gather hooks inside a block "
                          "break graph capture); drop --zero3-fetch module or --compile")
    if (t.compile and t.compile_scope == "model" and t.compiler == "torch"
            and (t.mode == "hybrid" or cfg.parallel.tp_size > 1)):
        raise ConfigError("--compile-scope model (one graph cut at DDP buckets) is for single/baseline without TP; "
                          "use --compile-scope blocks (or auto)")
    if t.precision == "fp16" and t.mode != "hybrid" and cfg.parallel.tp_size > 1:
        # GradScaler finds inf/NaN per rank; TP ranks hold different shards and could skip different steps
        raise ConfigError("--precision fp16 with --tp-size > 1 needs a GradScaler synchronised over the TP "
                          "group, which --mode baseline lacks; use --precision bf16, or --mode hybrid")
    check_sequence_parallel(cfg.parallel.tp_size, cfg.parallel.sequence_parallel)
    if cfg.checkpoint.resume == "auto" and not cfg.checkpoint.save_dir:
        raise ConfigError("--resume auto looks for the latest checkpoint in --save-dir; pass --save-dir "
                          "or --resume <checkpoint folder>")
    if (cfg.checkpoint.save_interval or cfg.checkpoint.keep_last) and not cfg.checkpoint.save_dir:
        raise ConfigError("--save-interval / --keep-last need --save-dir")
    _check_output_paths(cfg)


def check_folder_creatable(what: str, folder: Path, writable: bool = True) -> None:
    """A folder a run or tool will write must be creatable (and, with `writable`, writable by this user), checked
    before the work whose results it holds: a file in the way or a read-only parent fails now, not at the end."""
    path = folder.expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {folder} is a file, not a folder; pass a folder path")
    nearest = next(p for p in (path, *path.parents) if p.exists())  # the folder, or where creating it starts
    if not nearest.is_dir():
        raise ConfigError(f"{what} {folder} cannot be created: {nearest} is a file; pass another folder path")
    if writable and not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {folder} is not writable here ({nearest} is read-only for this user); pass a "
                          "folder you can write to")


def _check_output_paths(cfg: RunConfig) -> None:
    """The run's output folders (see check_folder_creatable); --cache-dir may be read-only (a shared cache serves
    hits; gpt2.data checks a miss), and --plan writes nothing."""
    name = cfg.log.run_name
    if name is not None and (not name or Path(name).name != name or name in (".", "..")):
        raise ConfigError(f"--run-name {name!r} must be a plain folder name (no '/'); --out-dir sets the parent")
    for flag, folder in (("--out-dir", cfg.log.out_dir), ("--save-dir", cfg.checkpoint.save_dir),
                         ("--cache-dir", cfg.data.cache_dir)):
        if folder is not None:
            check_folder_creatable(flag, Path(folder), writable=flag != "--cache-dir" and not cfg.plan.plan)


def parse_args(argv: list[str] | None = None) -> RunConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    validate(cfg)
    return cfg
