"""Train GPT-2: one entry point for every mode, installed as the `gpt2-train` console script (`train.py` in the
checkout is a shim over it, for `python train.py`, torchrun and deepspeed launches).

    gpt2-train --mode single --model gpt2-tiny --data synthetic                 # one device (CPU works)
    python train.py --mode single --model gpt2-tiny --data synthetic            # the same, from the checkout
    torchrun --nproc_per_node=4 train.py --mode baseline --model gpt2-large     # DDP
    torchrun --nproc_per_node=4 --no-python gpt2-train --mode baseline          # DDP, installed
    deepspeed --num_gpus=4 train.py --mode hybrid --tp-size 2                   # ZeRO-3 (+ TP)
    python train.py --plan --mode hybrid --model gpt2-large --gpus 4 [--search]  # predicted memory/communication

config -> process groups -> data (sharded by data-parallel rank) -> engine -> loop -> logs. This module is the
composition root: it makes the plan (gpt2.planning) and hands the loop a comparison function, so the loop never
imports the planner. Its top-level imports load no torch: `cli` installs the preemption watcher before torch loads.
Exit status: 0 trained to --max-steps; 2 bad configuration; 65 stopped after --max-bad-steps consecutive steps with
a non-finite loss or gradient norm, none applied or saved (gpt2/engines/guard.py; the message says what to change); 75
preempted by SIGUSR1/SIGTERM after saving a checkpoint (gpt2/train/preemption.py; rerun with --resume auto); 130
Ctrl-C (SIGINT): the same checkpoint at the next step boundary, or at once and without one on a second Ctrl-C; 74 a
save the file system refused (disk full: the message names the step and the newest good checkpoint;
gpt2/train/checkpoint.py), or a write of the run folder or the token cache (gpt2.observe.run_logging.WriteFailed).
"""

from __future__ import annotations

import functools
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpt2.config.cli import parse_args
from gpt2.config.schema import ConfigError
from gpt2.train.preemption import STARTUP_SIGNALS, PreemptionWatcher

if TYPE_CHECKING:
    from gpt2.config.layout import RunLayout

SCRIPT = "gpt2-train"  # the console script (pyproject.toml's [project.scripts])


def check_before_work(layout: RunLayout) -> None:
    """Start-up checks that need the launch (device, dp size) but come before data, a run folder or a model."""
    from gpt2.engines.build import check_backends
    from gpt2.observe.run_logging import wandb_mode

    cfg = layout.cfg
    check_backends(cfg)
    wandb_mode(cfg.log.wandb)  # --wandb online without credentials
    if cfg.train.init_from:  # its architecture must be this run's
        from gpt2.model.hf_weights import check_init_from

        check_init_from(cfg.train.init_from, cfg.model)


def resume_command(argv: list[str]) -> str:
    """This command line with `--resume auto` in place of any --resume, as the user launched it: `gpt2-train` (the
    console script) or `python train.py`."""
    kept: list[str] = []
    for arg, previous in zip(argv, [None, *argv]):
        if arg == "--resume" or arg.startswith("--resume=") or previous == "--resume":
            continue
        kept.append(arg)
    program = [SCRIPT] if Path(sys.argv[0]).name == SCRIPT else ["python", "train.py"]
    return shlex.join([*program, *kept, "--resume", "auto"])


def main(argv: list[str] | None = None, preemption: PreemptionWatcher | None = None) -> int:
    """Train; returns the exit status. `preemption`: the watcher `cli` installs before torch loads (a
    preemption during start-up then still checkpoints after step 1 and exits 75); default: one installed here. Its
    handlers are put back on return."""
    preemption = preemption or PreemptionWatcher(STARTUP_SIGNALS)
    try:
        return _run(sys.argv[1:] if argv is None else argv, preemption)
    finally:
        preemption.restore()


def _run(argv: list[str], preemption: PreemptionWatcher) -> int:
    try:
        cfg = parse_args(argv)
        if cfg.plan.plan:  # prints and exits: no process group, data or GPU
            from gpt2.planning.planner import run_plan_cli

            return run_plan_cli(cfg)
        import torch

        from gpt2.runtime.torch_support import check_torch_version

        if warning := check_torch_version(torch.__version__):
            print(f"train.py: warning: {warning}", file=sys.stderr)
        # imported after argument parsing so that `--help` and bad flags answer instantly
        from gpt2.data.loader import build_data
        from gpt2.engines.build import build_engine
        from gpt2.engines.guard import EXIT_NONFINITE, NonFiniteError
        from gpt2.model.flops import model_params_for_flops
        from gpt2.observe.profiling import check_profile_window
        from gpt2.observe.run_logging import MetricsLogger, WriteFailed, log, make_run_dir, setup_console
        from gpt2.planning.planner import compare_with_run, format_plan, plan_for_run
        from gpt2.runtime.distributed import init_distributed, shutdown_distributed
        from gpt2.train.checkpoint import (
            EXIT_SAVE_FAILED,
            Checkpointer,
            SaveError,
            load_checkpoint,
            newest_checkpoint,
            prepare_resume,
        )
        from gpt2.train.loop import run_training
        from gpt2.train.preemption import EXIT_INTERRUPTED, Preempted

        layout, ctx = init_distributed(cfg)
        try:
            check_before_work(layout)
        except ConfigError:
            shutdown_distributed(all_ranks_finished=False)
            raise
    except ConfigError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the watcher below: nothing trained yet
        print("train.py: interrupted (Ctrl-C) before training started", file=sys.stderr)
        return 130  # gpt2.preemption.EXIT_INTERRUPTED, perhaps not imported yet (it loads torch)
    logger = None
    finished = False
    # SIGUSR1 / SIGTERM (since start-up) / SIGINT from here on: checkpoint at the next step boundary, exit 75 (130 for
    # SIGINT)
    preemption.watch(signal.SIGINT)
    try:
        setup_console(None, ctx.is_main)
        # the plan is made once, here: the checkpoints get its size, the loop adds its comparison to the summary
        plan = plan_for_run(layout)
        checkpoint_size = plan.checkpoint_bytes
        # a bad --resume or a colliding --save-dir fails before data, a run folder or a model exist
        resume = prepare_resume(layout, ctx, checkpoint_size)  # recorded in the new run folder's config.json
        check_profile_window(cfg.train, resume.step if resume else 0)  # a resumed run profiles its own steps
        # data first: a bad --data-path or tokenizer fails before a run folder or a model exists
        data = build_data(
            cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size,
            model_vocab_size=cfg.model.vocab_size, dp_rank=ctx.dims.dp_rank, dp_size=ctx.dims.dp_size,
            seed=cfg.train.seed, is_main=ctx.is_main, barrier=ctx.barrier)
        run_dir = make_run_dir(cfg) if ctx.is_main else None
        setup_console(run_dir, ctx.is_main)
        log.info("run folder: %s", run_dir)
        log.info("data: %s", data.description)
        engine = build_engine(layout, ctx)
        log.info("model: %s, %.1fM parameters (FLOPs count), device %s, world %d (tp %d x dp %d)",
                 cfg.train.model, model_params_for_flops(cfg.model) / 1e6, ctx.device, ctx.world_size,
                 ctx.dims.tp_size, ctx.dims.dp_size)
        start_step = load_checkpoint(resume, layout, ctx, engine, data.train) if resume else 0
        checkpointer = (Checkpointer(layout, ctx, engine, data.train, checkpoint_size) if cfg.checkpoint.save_dir
                        else None)
        record = layout.config_record(resumed_from=str(resume.folder.resolve()) if resume else None)
        logger = MetricsLogger(cfg, run_dir, record) if ctx.is_main else None
        log.info("%s", format_plan(plan))
        run_training(layout, ctx, engine, data, logger, start_step=start_step, checkpointer=checkpointer,
                     preemption=preemption, compare=functools.partial(compare_with_run, plan))
        finished = True
    except SaveError as err:  # raised on every rank at the same save, like the stops below
        finished = True
        log.error("%s; exit %d", err, EXIT_SAVE_FAILED)
        return EXIT_SAVE_FAILED
    except WriteFailed as err:  # the run folder or the token cache (one process: no barrier to leave through)
        print(f"train.py: error: {err}; exit {EXIT_SAVE_FAILED}", file=sys.stderr)
        return EXIT_SAVE_FAILED
    except ConfigError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    # Both stops are collective: every rank takes the decision at the same step (an all-reduced preemption flag, the
    # global gradient norm), so the ranks leave together, through the barrier, as after a finished run. Without
    # it a rank could still be in gloo's teardown when its peer's connections closed (an abort, not the exit code).
    except Preempted as stop:
        finished = True
        if not cfg.checkpoint.save_dir:
            hint = "a rerun starts from scratch: pass --save-dir"
        elif ctx.world_size == 1:
            hint = f"resume with --resume auto: {resume_command(argv)}"
        else:
            hint = "resume with --resume auto (the same launch)"
        log.warning("%s; exit %d (%s)", stop, stop.exit_code, hint)
        return stop.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C: no step boundary waited for, no checkpoint of this step
        newest = newest_checkpoint(Path(cfg.checkpoint.save_dir)) if cfg.checkpoint.save_dir else "none (no --save-dir)"
        print(f"train.py: stopped at once by a second Ctrl-C; newest checkpoint: {newest}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except NonFiniteError as err:
        finished = True
        log.error("%s; exit %d", err, EXIT_NONFINITE)
        return EXIT_NONFINITE
    finally:
        if logger:
            logger.close()
        shutdown_distributed(all_ranks_finished=finished)
    return 0


def cli() -> None:
    """The launched process (`gpt2-train`, `python train.py`): the preemption watcher first, then `main`, leaving
    through run_as_process's exit."""
    watcher = PreemptionWatcher(STARTUP_SIGNALS)  # before torch loads: a preemption then is not a bare exit 143
    from gpt2.runtime.distributed import run_as_process

    run_as_process(functools.partial(main, preemption=watcher))
