"""What users run today: Hugging Face `GPT2LMHeadModel` under plain DDP or DeepSpeed ZeRO-3, measured like train.py.

    torchrun --nproc_per_node=4 -m tools.hf_reference --mode ddp --model gpt2-large --batch-size 8
    torchrun --nproc_per_node=4 -m tools.hf_reference --mode zero3 --model gpt2-large --batch-size 32
    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 -m tools.hf_reference --mode zero3 --model gpt2-tiny \
        --device cpu --batch-size 2 --seq-len 32 --max-steps 3                                  # CPU, gloo

The model comes from a `GPT2Config` with our preset's n_layer / n_embd / n_head (no hub download; HF's own
vocabulary of 50257, not padded), trained on synthetic tokens with `labels=input_ids` (HF shifts them).
  - ddp:   the model moved to the GPU, DistributedDataParallel, bf16 autocast, fused torch AdamW, clipping 1.0.
  - zero3: `GPT2LMHeadModel(config)` constructed inside `deepspeed.zero.Init` (DeepSpeed's recipe for building a
           model partitioned: each module's constructor and HF's `post_init` run, then its parameters are
           partitioned), torch AdamW passed to `deepspeed.initialize`, and the ZeRO-3 section of HF's
           documented example config with its "auto" values resolved as HF's Trainer resolves them.
Tokens/s, MFU (our FLOPs/token formula and peak table), memory and the run folder (config.json,
metrics.jsonl, summary.json, console.log) come from the same gpt2.observe.metrics / gpt2.observe.run_logging code as
train.py, so `tools.train_sweep` and the report can put these rows next to ours (the issue author's own numbers
for these trainers: docs/decisions.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpt2.config.layout import run_precision
from gpt2.config.schema import MODEL_PRESETS, DataConfig, LogConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from gpt2.model.flops import flops_per_token, model_params_for_flops
from gpt2.observe.metrics import LapTimer, MemoryStats, PeakMemory, ThroughputMeter, device_peak_tflops, host_cpu
from gpt2.observe.run_logging import MetricsLogger, log, make_run_dir, setup_console
from gpt2.runtime.distributed import run_as_process, shutdown_distributed
from tools import results_store

StepFn = Callable[[torch.Tensor], torch.Tensor]  # input ids [B, T] -> detached loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ddp", "zero3"], required=True)
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="gpt2-large")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per GPU")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-steps", type=int, default=25)
    p.add_argument("--throughput-warmup-steps", type=int, default=5)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="GPU only; CPU runs are fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--out-dir", default="runs")
    p.add_argument("--run-name", default=None)
    p.add_argument("--wandb", choices=["online", "offline", "disabled"], default=None)
    p.add_argument("--wandb-group", default=None)
    results_store.add_store_arguments(p)
    return p.parse_args(argv)


def run_config(args: argparse.Namespace) -> RunConfig:
    """Our RunConfig describing this run, so config.json, the run folder and wandb look like train.py's."""
    model = ModelConfig(**MODEL_PRESETS[args.model], pad_vocab=False)
    model.n_positions = max(model.n_positions, args.seq_len)
    train = TrainConfig(mode=f"hf-{args.mode}", model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                        max_steps=args.max_steps, throughput_warmup_steps=args.throughput_warmup_steps, lr=args.lr,
                        precision=args.precision, seed=args.seed, device=args.device)
    logs = LogConfig(out_dir=args.out_dir, run_name=args.run_name, wandb=args.wandb, wandb_group=args.wandb_group,
                     log_interval=args.log_interval, peak_tflops=args.peak_tflops)
    return RunConfig(train=train, model=model, data=DataConfig(data="synthetic"),
                     parallel=ParallelConfig(zero_stage=3 if args.mode == "zero3" else 0), log=logs)


def hf_config(model: ModelConfig):
    """GPT2Config with our preset's shape, dropout off (as our presets), no KV cache in training."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=model.n_layer, n_head=model.n_head, n_embd=model.n_embd, n_positions=model.n_positions,
                      vocab_size=model.vocab_size, resid_pdrop=model.dropout, embd_pdrop=model.dropout,
                      attn_pdrop=model.dropout, layer_norm_epsilon=model.layer_norm_eps, use_cache=False)


def zero3_ds_config(batch_size: int, hidden: int, bf16: bool) -> dict[str, Any]:
    """HF's documented ZeRO-3 example config; "auto" values resolved as `HfTrainerDeepSpeedConfig` does."""
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "zero_allow_untested_optimizer": True,  # torch AdamW
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_ddp(cfg: RunConfig, device: torch.device) -> tuple[StepFn, str]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2LMHeadModel

    torch.manual_seed(cfg.train.seed)
    model = GPT2LMHeadModel(hf_config(cfg.model)).to(device)
    attn = model.config._attn_implementation
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    bf16 = run_precision(cfg.train.precision, device.type) == "bf16"

    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, attn


def init_partitioned_weights(model: torch.nn.Module, deepspeed) -> None:
    """Run HF's `_init_weights` on whole tensors, as `from_config` does under ZeRO-3 (HF's Trainer path).

    Inside zero.Init, `post_init` meets parameters already partitioned to empty shards, so HF's init (std 0.02,
    scaled residual projections) does nothing and the torch defaults (N(0, 1) embeddings: loss ~45) remain.
    Like transformers' `initialize_weights_zero3`, gather each module's own and direct children's parameters
    (`_init_weights` touches e.g. `c_proj.weight` from the MLP) and let rank 0 initialise them.
    """
    rank = dist.get_rank()
    with torch.no_grad():
        for module in model.modules():
            params = {id(p): p for m in (module, *module.children()) for p in m.parameters(recurse=False)}
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
                if rank == 0:
                    model._init_weights(module)


def build_zero3(cfg: RunConfig, device: torch.device) -> tuple[StepFn, str]:
    from transformers import GPT2LMHeadModel

    from gpt2.engines.deepspeed_engine import import_deepspeed  # DS_ACCELERATOR and no op JIT-builds on CPU

    deepspeed = import_deepspeed(device)
    ds_config = zero3_ds_config(cfg.train.batch_size, cfg.model.n_embd,
                                run_precision(cfg.train.precision, device.type) == "bf16")
    torch.manual_seed(cfg.train.seed)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = GPT2LMHeadModel(hf_config(cfg.model))
    init_partitioned_weights(model, deepspeed)
    attn = model.config._attn_implementation
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config, dist_init_required=False)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, attn


def _world_max(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _peak_memory(memory: PeakMemory) -> dict[str, float]:
    mem = memory.peak
    peaks = _world_max([mem.peak_allocated_gib, mem.peak_reserved_gib, mem.alloc_retries], memory.device)
    return MemoryStats(peaks[0], peaks[1], int(peaks[2])).as_dict()


def train(cfg: RunConfig, device: torch.device, step_fn: StepFn, attn: str,
          logger: MetricsLogger | None) -> dict[str, Any]:
    """The timed loop: train.py's metrics (ThroughputMeter, LapTimer synchronised as train.py's loop does, peak
    memory max over ranks)."""
    t = cfg.train
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens_per_step = world * t.batch_size * t.seq_len
    fpt = flops_per_token(cfg.model, t.seq_len)
    peak = device_peak_tflops(device, cfg.log.peak_tflops)
    meter = ThroughputMeter(tokens_per_step=tokens_per_step, flops_per_token=fpt, hw_flops_per_token=fpt,
                            n_devices=world, peak_tflops=peak, warmup_steps=t.throughput_warmup_steps)
    memory = PeakMemory(device)
    gen = torch.Generator(device=device).manual_seed(t.seed + rank)  # disjoint synthetic batches per rank
    log.info("tokens/step %d (dp %d x batch %d x seq %d); FLOPs/token %.3e; peak %s TFLOP/s; attention %s",
             tokens_per_step, world, t.batch_size, t.seq_len, fpt, peak, attn)
    last: dict[str, Any] = {}
    start = time.perf_counter()
    timer = LapTimer(device)
    for step in range(1, t.max_steps + 1):
        ids = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len), device=device, generator=gen)
        loss = step_fn(ids)
        log_due = step % cfg.log.log_interval == 0 or step in (1, t.max_steps)
        meter.record(step, timer.lap(sync=step == meter.warmup_steps or log_due))
        memory.observe()
        if log_due:
            loss_mean = loss.float().clone()
            dist.all_reduce(loss_mean)
            rates = meter.interval()
            last = {"loss": loss_mean.item() / world, **rates,
                    **_peak_memory(memory), "tokens_seen": step * tokens_per_step}
            if logger:
                logger.log_step(step, last)
            mfu = f"{100 * rates['mfu']:.1f}%" if rates["mfu"] is not None else "n/a"
            log.info("step %d/%d | loss %.4f | %s tok/s | MFU %s | mem %.2f GiB", step, t.max_steps, last["loss"],
                     f"{rates['tokens_per_s']:,.0f}", mfu, last["mem/peak_allocated_gib"])
    train_time = time.perf_counter() - start
    summary = {
        "mode": t.mode, "model": t.model, "n_params": model_params_for_flops(cfg.model), "world_size": world,
        "tp_size": 1, "dp_size": world, "batch_size_per_gpu": t.batch_size, "grad_accum": 1, "seq_len": t.seq_len,
        "tokens_per_step": tokens_per_step, "precision": run_precision(t.precision, device.type),
        "fused_kernels": "none", "attn": attn, "compile": False, "activation_checkpointing": False,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "host_cpu": host_cpu(),
        "peak_tflops_per_gpu": peak, "flops_per_token": fpt, "steps": t.max_steps, "train_time_s": train_time,
        **meter.summary(), **_peak_memory(memory), "final_loss": last.get("loss"), "final_accuracy": None,
        "torch_version": torch.__version__, "profiled": False, "implementation": "hf-transformers",
    }
    if logger:
        logger.log_summary(summary)
    tok_s, mfu = summary["tokens_per_s"], summary["mfu"]
    log.info("summary: %s %s | %s tok/s | MFU %s | peak mem %.2f GiB | final loss %.4f", t.mode, t.model,
             f"{tok_s:,.0f}" if tok_s else "n/a", f"{100 * mfu:.1f}%" if mfu else "n/a",
             summary["mem/peak_allocated_gib"], summary["final_loss"])
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        print("hf_reference: launch with torchrun --nproc_per_node=N -m tools.hf_reference ...", file=sys.stderr)
        return 2
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=10),
                            device_id=device if use_cuda else None)
    cfg = run_config(args)
    logger = None
    finished = False
    try:
        is_main = dist.get_rank() == 0
        run_dir = make_run_dir(cfg) if is_main else None
        setup_console(run_dir, is_main)
        log.info("run folder: %s", run_dir)
        step_fn, attn = (build_ddp if args.mode == "ddp" else build_zero3)(cfg, device)
        log.info("model: HF GPT2LMHeadModel %s (%s), %.1fM parameters (FLOPs count), world %d", args.model,
                 args.mode, model_params_for_flops(cfg.model) / 1e6, dist.get_world_size())
        logger = MetricsLogger(cfg, run_dir) if is_main else None
        summary = train(cfg, device, step_fn, attn, logger)
        if is_main and args.store:
            results_store.append_rows([results_store.row_from_summary(
                {**summary, "engine": "hf"}, call=args.call, raw=run_dir / "summary.json", kind="reference",
                variant=args.mode)], args.store)
        finished = True
    finally:
        if logger:
            logger.close()
        shutdown_distributed(all_ranks_finished=finished)
    return 0


if __name__ == "__main__":
    run_as_process(main)
