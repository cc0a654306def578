"""Every `torch.compile` of the harness, and the Inductor settings each one needs to train the right function.

Three ways a model is compiled (`--compile-scope`, resolved in `gpt2.config.schema`):
- `compile_whole`: the whole (DDP-wrapped) model as one graph cut at DDP buckets (scope `model`);
- `compile_model`: each block, the final LayerNorm and the LM head + loss in place (scope `blocks`);
- `compile_forwards`: the same parts' forwards only, module hooks left eager (ZeRO-3 with per-block gathers).

Each applies `INDUCTOR_SETTINGS` first. Why (CUDA, torch 2.11, bf16; reproduced standalone by
`benchmarks/repro/inductor_loop_ordering_inplace.py`; the numbers: docs/decisions.md): with Inductor's defaults, a
whole-model graph of a GPT-2 of width 1280 and two or more blocks computes a wrong training forward (the step-0 loss
and the tied embedding's gradient off, GPT-2 Large diverging) while the same graph under `aot_eager` is exact.
Turning off either `loop_ordering_after_fusion` or `inplace_buffers` makes it exact (pattern matcher, padding,
split or persistent reductions, online softmax, mix-order reductions, buffer reuse and epilogue fusion do not);
Inductor's compiler bisector blames the lowering of one bf16 cast. Loop re-ordering after fusion is the one
turned off: it costs less throughput than `inplace_buffers=False`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from gpt2.model.gpt import GPT, LMHead

INDUCTOR_SETTINGS: dict[str, Any] = {"loop_ordering_after_fusion": False}
# torch._dynamo and Inductor's config are imported where a compile is set up, not with this module: importing them
# takes ~1.5 s of CPU a process, which every eager run (most of the CPU suite's launches) would pay for nothing


def apply_inductor_settings(cpp_wrapper: bool = False) -> None:
    """Set `INDUCTOR_SETTINGS` (process-wide Inductor config, read when a graph is compiled), and the kind of host
    code that launches each graph's kernels (`RunLayout.inductor_cpp_wrapper`: C++ or Python; the same kernels)."""
    import torch._inductor.config

    for name, value in {**INDUCTOR_SETTINGS, "cpp_wrapper": cpp_wrapper}.items():
        setattr(torch._inductor.config, name, value)


def compiled_parts(model: GPT) -> list[nn.Module]:
    """What the per-part scopes compile: each block, the final LayerNorm and the LM head + loss. The vocab-parallel
    head (TP) stays eager: Dynamo cannot capture its autograd.Function, whose in-place softmax buffer is saved for
    backward (and it never materialises more than this rank's logits anyway)."""
    head = [model.lm_head] if isinstance(model.lm_head, LMHead) else []
    return [*model.blocks, model.ln_f, *head]


def compile_whole(model: nn.Module, cpp_wrapper: bool = False) -> nn.Module:
    """The whole model as one compiled module; given the DDP wrapper, Dynamo's DDPOptimizer cuts the graph at
    bucket boundaries, so gradient all-reduces still overlap the backward pass."""
    apply_inductor_settings(cpp_wrapper)
    return torch.compile(model)


def compile_model(model: GPT, cpp_wrapper: bool = False) -> None:
    """torch.compile in place (state-dict keys unchanged) the `compiled_parts`, so the logits slice, fp32 upcast,
    cross-entropy and argmax fuse instead of running as eager passes."""
    apply_inductor_settings(cpp_wrapper)
    for module in compiled_parts(model):
        module.compile()


def compile_forwards(model: GPT, cpp_wrapper: bool = False) -> None:
    """torch.compile the forward of the `compiled_parts`, leaving the modules' hooks outside the graphs: under
    ZeRO-3 (blocks as DeepSpeed leaf modules) the pre-forward hook gathers a block's parameters eagerly, then the
    compiled forward sees them whole."""
    # On CUDA, ZeRO-3's gathered block parameters fail a guard of the previous block's graph, so Dynamo compiles
    # the shared Block.forward once per block (reused every step after that); at its default limit of 8 the
    # other blocks of GPT-2 Large ran eagerly (the log says "hit config.recompile_limit (8)").
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(model.blocks) + 8)
    apply_inductor_settings(cpp_wrapper)
    for module in compiled_parts(model):
        module.forward = torch.compile(module.forward)


def deepcompile_eval_settings(deepcompile: bool) -> contextlib.AbstractContextManager[None]:
    """Inductor settings for the graphs DeepCompile compiles at evaluation (no grad). Inductor asserts the 16-byte
    alignment of every output of a fallback op, even one the op leaves undefined; the no-grad graph calls
    `_scaled_dot_product_cudnn_attention`, whose logsumexp is undefined without gradients, and the assert raises
    `TypeError: expected Tensor()` (pytorch/pytorch#196226; seen on CUDA, torch 2.11). The assert is a check
    only: without it the eval graph is the same. Training graphs compile outside this and keep the assert."""
    if not deepcompile:
        return contextlib.nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch(alignment_asserts=False)
