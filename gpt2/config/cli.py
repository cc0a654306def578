"""train.py's command line, built from the config schema (`gpt2.config.schema`: each flag's default, help, parser
and group are written once, on its field), and the checks that need nothing but the parsed config.

`parse_args()` turns argv into a `RunConfig` and rejects bad input with an error that names the fix, before any
heavy work. `python -m gpt2.config.cli` prints the flags page (docs/flags.md) from the same parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

from gpt2.config.schema import (
    DEEPCOMPILE_RECOMPILE_STEP,
    GROUPS,
    KERNELS,
    MAX_LAYERS,
    MODEL_PRESETS,
    THROUGHPUT_WARMUP_STEPS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    Flag,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    PlanConfig,
    RunConfig,
    TrainConfig,
    compile_label,
    finite_float,
    flag_of,
    unit_divisors,
)

# RunConfig's sections, in the order the parser reads their fields
SECTIONS: dict[str, type] = {"train": TrainConfig, "model": ModelConfig, "data": DataConfig,
                             "parallel": ParallelConfig, "checkpoint": CheckpointConfig, "log": LogConfig,
                             "plan": PlanConfig}
RUN_NAME_SUFFIX_ROOM = 4  # bytes kept for the "-N" that make_run_dir appends to a taken run name
HELP_WIDTH = 100  # the flags page's width (docs/flags.md), whatever the terminal's


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has one; a flag whose parser default is None says in its help what applies
    without it (`Flag.default_text`, or the field's default for a given-only flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        negated_switch = action.nargs == 0 and action.default is True  # a --no-... flag: its help says it all
        return action.help if action.default is None or negated_switch else super()._get_help_string(action)


def _value_parser(hint: Any) -> tuple[Any, tuple[Any, ...] | None]:
    """(parser of one value, choices) from a field's type: a Literal gives its values, `X | None` and list[X] X's; a
    float must be finite (nan and inf parse as floats, and each trains to NaN or silently turns a check off)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0]), tuple(args)
    if args:  # X | None, list[X], Literal[...] | None
        return _value_parser(args[0])
    return (finite_float if hint is float else hint), None


def _shown_default(f: dataclasses.Field) -> Any:
    """A field's default as --help shows it (a list's elements, space-separated, as they are typed)."""
    if f.default_factory is not dataclasses.MISSING:
        return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in f.default_factory())
    return f.default


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any, flag: Flag) -> None:
    names = flag.names or (f"--{f.name.replace('_', '-')}",)
    help_text = flag.help
    if flag.given_only or flag.default_text:
        help_text += f" (default: {flag.default_text if flag.default_text else _shown_default(f)})"
    if hint is bool:  # a switch: on when given, or off when given for a field that is on by default
        group.add_argument(*names, dest=f.name, action="store_false" if f.default else "store_true", help=help_text)
        return
    parse, choices = _value_parser(hint)
    default = None if flag.given_only else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    group.add_argument(*names, dest=f.name, type=flag.parse or parse, choices=flag.choices or choices,
                       nargs=flag.nargs, metavar=flag.metavar, default=default, help=help_text)


def build_parser(width: int | None = None) -> argparse.ArgumentParser:
    """train.py's parser: one argument per schema field that has a flag, in the schema's groups."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train GPT-2 with single-device, DDP or DeepSpeed ZeRO-3 (+ tensor parallel).",
        formatter_class=lambda prog: _HelpFormatter(prog, width=width),
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for section in SECTIONS.values():
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            if (flag := flag_of(f)) is not None:
                _add_flag(groups[flag.group], f, hints[f.name], flag)
    groups[KERNELS].add_argument("--use-fused-kernel", action="store_true", help="alias of --fused-kernels cuda")
    # the `deepspeed` launcher appends --local_rank=N; the LOCAL_RANK environment variable is what we read
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return p


def _section(cls: type, args: argparse.Namespace, **derived: Any) -> Any:
    """A config section from the parsed flags: a flag left out (None for a given-only flag) keeps the field's
    default; `derived` are the values this module decides from several flags."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if flag_of(f) is not None and getattr(args, f.name) is not None}
    return cls(**{**values, **derived})


def throughput_warmup_default(deepcompile: bool) -> int:
    """Steps excluded from tokens/s and MFU when --throughput-warmup-steps is not given: under DeepCompile, every
    step up to its re-compile (DEEPCOMPILE_RECOMPILE_STEP), which are compile and profiling time."""
    return DEEPCOMPILE_RECOMPILE_STEP + 1 if deepcompile else THROUGHPUT_WARMUP_STEPS


def resolve_compile_scope(requested: str, mode: str, tp_size: int, compiler: str = "torch") -> str:
    """`auto`: one whole-model graph for single/DDP without TP (faster there than per-block graphs: less host work
    a step; docs/decisions.md), per-block graphs elsewhere (ZeRO hooks, TP collectives).
    DeepCompile always compiles the whole model (`engine.compile()`): `model`; it has no per-block scope."""
    if compiler == "deepcompile":
        if requested == "blocks":
            raise ConfigError("--compiler deepcompile compiles the whole model as one graph (DeepSpeed's "
                              "engine.compile()); drop --compile-scope blocks or use --compiler torch")
        return "model"
    if requested != "auto":
        return requested
    return "model" if mode in ("single", "baseline") and tp_size == 1 else "blocks"


def check_deepcompile(args: argparse.Namespace) -> None:
    """`--compiler deepcompile`: the combinations DeepSpeed's DeepCompile (0.19.8) cannot run, or this harness
    has not wired, each an error naming the fix. The CUDA and torch-version needs are `gpt2.config.layout`'s
    (device)."""
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
                          "under zero.Init, and Dynamo cannot capture the vocab-parallel head, "
                          "gpt2.runtime.compiling); use --tp-size 1, or --compiler torch")
    if args.zero3_fetch is not None or args.zero3_unit_blocks is not None:
        raise ConfigError("--compiler deepcompile removes ZeRO-3's gather hooks and gathers each parameter inside "
                          "the compiled graph, so there is no fetch unit to choose; drop --zero3-fetch and "
                          "--zero3-unit-blocks")
    if args.comm_log:
        raise ConfigError("--comm-log reads DeepSpeed's comms logger, which DeepCompile's collectives (issued by its "
                          "C++ op on the process group) bypass; drop --comm-log or use --compiler torch")




def check_zero_engine(args: argparse.Namespace) -> None:
    """`--zero-engine fsdp2`: what FSDP2 (gpt2.engines.fsdp2_engine) cannot take, each an error naming the fix; the
    DeepSpeed-only flags among them."""
    if args.zero_engine != "fsdp2":
        fsdp2_only = [flag for flag, value in (("--fsdp2-unit-blocks", args.fsdp2_unit_blocks),
                                               ("--fsdp2-gather", args.fsdp2_gather),
                                               ("--fsdp2-forward-prefetch", args.fsdp2_forward_prefetch),
                                               ("--fsdp2-params", args.fsdp2_params))
                      if value is not None]
        if fsdp2_only:
            one = len(fsdp2_only) == 1
            raise ConfigError(f"{' / '.join(fsdp2_only)}: {'an FSDP2 setting' if one else 'FSDP2 settings'}; add "
                              f"--mode hybrid --zero-engine fsdp2 or drop {'it' if one else 'them'}")
        return
    if args.mode != "hybrid":
        raise ConfigError(f"--zero-engine fsdp2 picks who shards under --mode hybrid; --mode {args.mode} shards "
                          "nothing: use --mode hybrid or drop --zero-engine")
    if args.zero_stage == 1:
        raise ConfigError("--zero-stage 1 (only the optimizer state sharded) has no FSDP2 equivalent: FSDP2 always "
                          "shards gradients too; use --zero-stage 2 or 3, or --zero-engine deepspeed")
    if args.precision == "fp16":
        raise ConfigError("--precision fp16 under --zero-engine fsdp2 needs a loss scaler over FSDP2's sharded "
                          "gradients, which is not wired; use --precision bf16 (fp32's range), or --zero-engine "
                          "deepspeed")
    deepspeed_only = [flag for flag, value in (
        ("--ds-config", args.ds_config), ("--zero3-fetch", args.zero3_fetch),
        ("--zero3-unit-blocks", args.zero3_unit_blocks), ("--zero-precision", args.zero_precision),
        ("--deepspeed-nvtx", args.deepspeed_nvtx or None),
        ("--compiler deepcompile", "deepcompile" if args.compiler == "deepcompile" else None)) if value is not None]
    if deepspeed_only:
        raise ConfigError(f"{' / '.join(deepspeed_only)}: DeepSpeed settings, which --zero-engine fsdp2 does not "
                          f"read; drop {'it' if len(deepspeed_only) == 1 else 'them'} or use --zero-engine deepspeed")


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
    if args.compile_scope not in (None, "auto") and not args.compile:
        raise ConfigError(f"--compile-scope {args.compile_scope} says what --compile compiles; add --compile or drop "
                          "it")
    if args.compile_wrapper is not None and not args.compile:
        raise ConfigError(f"--compile-wrapper {args.compile_wrapper} picks the host code of torch.compile's graphs; "
                          "add --compile or drop it")
    if args.compile_wrapper is not None and args.compiler == "deepcompile":
        raise ConfigError("--compile-wrapper picks the host code of torch.compile's graphs, and DeepCompile builds "
                          "its own: drop --compile-wrapper or use --compiler torch")
    if args.compiler == "torch" and not args.compile:
        raise ConfigError("--compiler torch says who compiles under --compile; add --compile or drop it")
    if args.ddp_bucket_mb is not None and args.mode != "baseline":
        raise ConfigError(f"--ddp-bucket-mb sizes DDP's gradient buckets, used only by --mode baseline (--mode "
                          f"{args.mode} has no DDP); drop it")
    if args.mode == "hybrid" and args.zero3_fetch is not None and (args.zero_stage or ParallelConfig.zero_stage) != 3:
        raise ConfigError(f"--zero3-fetch chooses what ZeRO-3 gathers at once; --zero-stage {args.zero_stage} keeps "
                          "whole parameters on every rank and gathers nothing: drop it or use --zero-stage 3")
    if args.mode == "hybrid" and args.zero3_unit_blocks is not None and (
            (args.zero_stage or ParallelConfig.zero_stage) != 3 or args.zero3_fetch == "module"):
        raise ConfigError("--zero3-unit-blocks groups transformer blocks into ZeRO-3 leaf modules, which needs "
                          "--zero-stage 3 with --zero3-fetch block or flat (module: DeepSpeed's hooks on every "
                          "module); drop it or change those")
    if args.eval_interval and not args.eval_batches:
        raise ConfigError(f"--eval-interval {args.eval_interval} evaluates every {args.eval_interval} steps, and "
                          "--eval-batches 0 turns evaluation off; drop one of the two")
    if not args.tp_overlap and args.tp_size == 1:
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


def resolve_optimizer(args: argparse.Namespace) -> None:
    """`--optimizer auto` becomes the implementation the run steps with, so config.json and the parity key name it:
    the Triton AdamW under either fused-kernel set (triton, cuda) wherever it can step (torch's AdamW state: single,
    DDP, FSDP2), torch's elsewhere; `none` stays PyTorch's own. An explicit `--optimizer triton` under DeepSpeed is
    refused: DeepSpeed steps its own partitions."""
    keeps_torch_state = args.mode != "hybrid" or args.zero_engine == "fsdp2"
    if args.optimizer == "auto":
        args.optimizer = "triton" if args.fused_kernels != "none" and keeps_torch_state else "torch"
    elif args.optimizer == "triton" and not keeps_torch_state:
        raise ConfigError("--optimizer triton steps torch's AdamW state, which DeepSpeed does not keep (it steps its "
                          "own flat partitions); drop --optimizer triton or add --zero-engine fsdp2")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    if args.use_fused_kernel and args.fused_kernels not in ("none", "cuda"):
        raise ConfigError("--use-fused-kernel means --fused-kernels cuda; drop one of the two flags")
    if args.use_fused_kernel:
        args.fused_kernels = "cuda"
    check_zero_engine(args)
    resolve_optimizer(args)
    check_deepcompile(args)
    check_flags_act(args)
    if args.grad_accum is not None and args.global_batch_size is not None:
        raise ConfigError("--global-batch-size sets the accumulation steps itself; drop --grad-accum "
                          f"{args.grad_accum} or --global-batch-size {args.global_batch_size}")
    zero_flags = [flag for flag, value in (("--zero-stage", args.zero_stage), ("--zero3-fetch", args.zero3_fetch),
                                           ("--zero3-unit-blocks", args.zero3_unit_blocks),
                                           ("--zero-precision", args.zero_precision),
                                           ("--deepspeed-nvtx", args.deepspeed_nvtx or None),
                                           ("--zero-engine", args.zero_engine)) if value is not None]
    if zero_flags and args.mode != "hybrid":
        raise ConfigError(f"{' / '.join(zero_flags)}: DeepSpeed ZeRO settings, used only by --mode hybrid; "
                          f"drop {'it' if len(zero_flags) == 1 else 'them'} or use --mode hybrid")
    if args.busbw_gbs is not None and len(args.busbw_gbs) > 2:
        raise ConfigError(f"--busbw-gbs takes one or two values (within a node, across nodes), got "
                          f"{len(args.busbw_gbs)}")
    if args.search and not args.plan:
        raise ConfigError("--search ranks layouts for --plan; add --plan")
    compiler = args.compiler or TrainConfig.compiler
    deepcompile = compile_label(args.compile, "model", compiler) == "deepcompile"
    train = _section(
        TrainConfig, args,
        throughput_warmup_steps=(args.throughput_warmup_steps if args.throughput_warmup_steps is not None else
                                 throughput_warmup_default(deepcompile)),
        compile_scope=resolve_compile_scope(args.compile_scope or "auto", args.mode, args.tp_size, compiler))
    model = _section(ModelConfig, args, **{key: value for key, value in MODEL_PRESETS[args.model].items()
                                           if getattr(args, key, None) is None})
    if args.fsdp2_unit_blocks is not None and args.fsdp2_unit_blocks > model.n_layer:
        raise ConfigError(f"--fsdp2-unit-blocks {args.fsdp2_unit_blocks} is more blocks than the model's "
                          f"{model.n_layer}; use 1 to {model.n_layer} ({model.n_layer}: all blocks one unit)")
    if args.zero3_unit_blocks is not None and model.n_layer % args.zero3_unit_blocks:
        raise ConfigError(f"--zero3-unit-blocks {args.zero3_unit_blocks} does not divide the model's {model.n_layer} "
                          f"blocks; use one of {unit_divisors(model.n_layer)}")
    return RunConfig(train=train, model=model, data=_section(DataConfig, args),
                     parallel=_section(ParallelConfig, args), log=_section(LogConfig, args),
                     checkpoint=_section(CheckpointConfig, args), plan=_section(PlanConfig, args))


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
    if t.compile and cfg.zero_stage == 3 and cfg.parallel.zero3_fetch == "module":
        raise ConfigError("--compile with ZeRO-3 needs --zero3-fetch block or flat (per-module gather hooks inside a "
                          "block break graph capture); drop --zero3-fetch module or --compile")
    unit = cfg.parallel.fsdp2_unit_blocks  # given (left out: a divisor, gpt2.config.layout.fsdp2_unit_blocks_of)
    if cfg.parallel.fsdp2_params == "flat" and unit is not None and m.n_layer % unit:
        raise ConfigError(f"--fsdp2-params flat needs units of one size, and {unit}-block units do not divide the "
                          f"model's {m.n_layer} blocks; pass --fsdp2-unit-blocks with one of "
                          f"{unit_divisors(m.n_layer)}, or --fsdp2-params tensors")  # one flat layout for every unit
    if (t.compile and t.compile_scope == "model" and t.compiler == "torch"
            and (t.mode == "hybrid" or cfg.parallel.tp_size > 1)):
        raise ConfigError("--compile-scope model (one graph cut at DDP buckets) is for single/baseline without TP; "
                          "use --compile-scope blocks (or auto)")
    if t.precision == "fp16" and t.mode != "hybrid" and cfg.parallel.tp_size > 1:
        # GradScaler finds inf/NaN per rank; TP ranks hold different shards and could skip different steps
        raise ConfigError("--precision fp16 with --tp-size > 1 needs a GradScaler synchronised over the TP "
                          "group, which --mode baseline lacks; use --precision bf16, or --mode hybrid")
    if cfg.parallel.sequence_parallel and cfg.parallel.tp_size == 1:
        raise ConfigError("--sequence-parallel shards the sequence over the tensor-parallel group; "
                          "pass --tp-size > 1 or drop --sequence-parallel")
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
    nearest = next(p for p in (path, *path.parents) if _exists(p))  # the folder, or where creating it starts
    limit = name_max(nearest if nearest.is_dir() else nearest.parent)
    if long := [part for part in path.relative_to(nearest).parts if len(part.encode()) > limit]:
        raise ConfigError(f"{what} {folder}: the name {long[0][:40]}... is longer than the file system's {limit} "
                          "bytes; pass a shorter path")
    if nearest == path and not path.is_dir():
        raise ConfigError(f"{what} {folder} is a file, not a folder; pass a folder path")
    if not nearest.is_dir():
        raise ConfigError(f"{what} {folder} cannot be created: {nearest} is a file; pass another folder path")
    if writable and not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {folder} is not writable here ({nearest} is read-only for this user); pass a "
                          "folder you can write to")


def _exists(path: Path) -> bool:
    """Path.exists, False for a name too long to look up (ENAMETOOLONG, which exists() raises)."""
    try:
        return path.exists()
    except OSError:
        return False


def name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system of `folder` (an existing folder) takes."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255  # POSIX file systems' usual limit, where the system does not say


def _run_name_max(out_dir: Path) -> int:
    """The longest --run-name that gpt2.observe.run_logging.make_run_dir can create under `out_dir`, suffix included."""
    nearest = next(p for p in (out_dir, *out_dir.parents) if _exists(p) and p.is_dir())
    return name_max(nearest) - RUN_NAME_SUFFIX_ROOM


def _check_output_paths(cfg: RunConfig) -> None:
    """The run's output folders (see check_folder_creatable); --cache-dir may be read-only (a shared cache serves
    hits; gpt2.data.loader checks a miss), and --plan writes nothing."""
    name = cfg.log.run_name
    if name is not None and (not name or Path(name).name != name or name in (".", "..")):
        raise ConfigError(f"--run-name {name!r} must be a plain folder name (no '/'); --out-dir sets the parent")
    if name is not None and len(name.encode()) > (limit := _run_name_max(Path(cfg.log.out_dir))):
        raise ConfigError(f"--run-name is {len(name.encode())} bytes long; at most {limit} here (the file system's "
                          f"file name limit, less room for the '-N' a taken name gets): pass a shorter --run-name")
    for flag, folder in (("--out-dir", cfg.log.out_dir), ("--save-dir", cfg.checkpoint.save_dir),
                         ("--cache-dir", cfg.data.cache_dir)):
        if folder is not None:
            check_folder_creatable(flag, Path(folder), writable=flag != "--cache-dir" and not cfg.plan.plan)


def parse_args(argv: list[str] | None = None) -> RunConfig:
    cfg = config_from_args(build_parser().parse_args(argv))
    validate(cfg)
    return cfg


def flags_page() -> str:
    """docs/flags.md's generated part: `train.py --help` at a fixed width (tests/unit/test_readme.py checks it)."""
    return build_parser(width=HELP_WIDTH).format_help()


if __name__ == "__main__":
    sys.stdout.write(flags_page())
