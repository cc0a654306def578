"""Build the run's engine, and check before any work that the kernels it will use can run here."""

from __future__ import annotations

import torch

from fused_kernels import KernelUnavailableError
from fused_kernels.attention import check_device, get_attention
from gpt2.config.layout import RunLayout
from gpt2.config.schema import ConfigError, RunConfig
from gpt2.engines.base import Engine
from gpt2.engines.deepspeed_engine import DeepSpeedEngine
from gpt2.engines.torch_engine import TorchEngine
from gpt2.runtime.distributed import DistContext
from gpt2.runtime.parallelize import kernel_ops


def check_backends(cfg: RunConfig) -> None:
    """A fused-kernel or attention backend that cannot run here is a ConfigError now, not a failure later."""
    try:
        kernel_ops(cfg)  # builds what the run will use
        if cfg.train.optimizer == "triton":
            check_triton_optimizer()
        get_attention(cfg.train.attn)
        on_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
        check_device(cfg.train.attn, "cuda" if on_cuda else "cpu")
    except KernelUnavailableError as err:
        raise ConfigError(str(err)) from err


def check_triton_optimizer() -> None:
    """`--optimizer triton`: KernelUnavailableError unless its kernels (`fused_kernels.triton.adamw`) can run here;
    Triton is imported only then."""
    chosen = "--optimizer triton (what --optimizer auto picks under --fused-kernels triton or cuda)"
    try:
        from fused_kernels.triton import check_available
        from fused_kernels.triton.adamw import adamw_kernel
    except ImportError as e:
        raise KernelUnavailableError(f"{chosen}: Triton cannot be imported here ({e}); use --optimizer torch") from e
    check_available(adamw_kernel, chosen, "--optimizer torch")


def build_engine(layout: RunLayout, ctx: DistContext) -> Engine:
    """The engine of the run's mode: TorchEngine (single, baseline), DeepSpeedEngine (hybrid) or FSDP2Engine
    (hybrid, --zero-engine fsdp2)."""
    if layout.fsdp2:
        from gpt2.engines.fsdp2_engine import FSDP2Engine

        return FSDP2Engine(layout, ctx)
    if layout.mode == "hybrid":
        return DeepSpeedEngine(layout, ctx)
    return TorchEngine(layout, ctx)
