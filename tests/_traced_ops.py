"""Trace every Triton op the way torch.compile does on a GPU, without one: fake CUDA tensors, kernels compiled
(not interpreted), AOTAutograd's functionalisation. Prints one line per op and exits 1 on any failure.

Run as `python -m tests._traced_ops` with TRITON_INTERPRET unset: under the interpreter the ops are opaque
custom_ops, so only here do the `triton_op` bodies get traced as they will be on the GPU (make_fx-traceable,
every launch captured as `triton_kernel_wrapper_functional`, autotune pruning and grids evaluated), and only
here does torch's analysis of what each kernel writes run: an argument it counts as written but that the kernel
only reads would be copied before every launch. The CE op stays an opaque call; with GPT2_OPAQUE_KERNELS=1
every op must. Shapes are dynamic (symbolic row counts, as after a recompile for a new batch size). The graphs
are only captured, never run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from types import SimpleNamespace

import torch
import triton
from torch._functorch.aot_autograd import aot_function
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget

from tests._triton_compile import _jit

OPAQUE = os.environ.get("GPT2_OPAQUE_KERNELS", "0") not in ("", "0")
ALWAYS_OPAQUE = {"triton_lm_cross_entropy"}
WRITTEN = {  # the arguments each kernel stores to
    "bias_gelu_fwd_kernel": {"y_ptr"},
    "bias_gelu_bwd_kernel": {"dx_ptr"},
    "matmul_bias_gelu_kernel": {"y_ptr", "pre_ptr"},
    "add_layernorm_fwd_kernel": {"y_ptr", "r_ptr", "mean_ptr", "rstd_ptr"},
    "add_layernorm_bwd_kernel": {"dr_ptr", "dw_part_ptr", "db_part_ptr"},
}


class _Captured(Exception):
    """Stops aot_function once the forward graph is built (running it would need a GPU)."""


def _graph(fn: Callable, args: list[torch.Tensor]) -> torch.fx.Graph:
    """The functionalised forward graph of fn(*args)."""
    graphs = []

    def capture(gm: torch.fx.GraphModule, _inputs):
        graphs.append(gm)
        raise _Captured

    with contextlib.suppress(_Captured):
        aot_function(fn, fw_compiler=capture, dynamic=True)(*args)
    return graphs[0].graph


def _cases(t: Callable) -> list[tuple[str, Callable, list[torch.Tensor]]]:
    """(op and variant, fn, fake inputs): each op's forward and backward, called directly (autograd needs a real
    CUDA device even for fake tensors, so each backward op is traced on its own)."""
    from fused_kernels.triton.bias_gelu import bias_gelu_backward_op, bias_gelu_op
    from fused_kernels.triton.cross_entropy import lm_cross_entropy_forward
    from fused_kernels.triton.layernorm import add_layernorm_backward, add_layernorm_forward
    from fused_kernels.triton.matmul_gelu import matmul_bias_gelu

    bf16, f32 = torch.bfloat16, torch.float32
    M, K, N, V = 48, 64, 256, 500
    x, w, b, pre = t(M, K), t(N, K), t(N), t(M, N)
    r, w32, stats = t(M, K), t(K, dtype=f32), t(M, dtype=f32)
    targets = t(M, dtype=torch.int64)
    return [
        ("triton_bias_gelu", lambda x, b: bias_gelu_op(x, b), [pre, b]),
        ("triton_bias_gelu_backward", lambda dy, x: bias_gelu_backward_op(dy, x, None), [pre, pre]),
        ("triton_matmul_bias_gelu", lambda x, w, b: matmul_bias_gelu(x, w, b, True), [x, w, b]),
        ("triton_matmul_bias_gelu no bias, no pre", lambda x, w: matmul_bias_gelu(x, w, None, False), [x, w]),
        ("triton_add_layernorm", lambda x, r, w, b: add_layernorm_forward(x, r, w, b, 1e-5, f32), [x, r, w32, w32]),
        ("triton_add_layernorm no residual", lambda x, w, b: add_layernorm_forward(x, None, w, b, 1e-5, bf16),
         [x, w32, w32]),
        ("triton_add_layernorm_backward", add_layernorm_backward, [t(M, K, dtype=f32), r, r, w32, stats, stats]),
        ("triton_add_layernorm_backward no dr_out", lambda dy, r, w, m, s: add_layernorm_backward(dy, None, r, w, m, s),
         [t(M, K, dtype=f32), r, w32, stats, stats]),
        ("triton_lm_cross_entropy", lambda h, w, tg: lm_cross_entropy_forward(h, w, tg, V, bf16, True, 16),
         [x, t(512, K), targets]),
    ]


def main() -> int:
    from fused_kernels.triton.matmul_gelu import matmul_bias_gelu_kernel
    from fused_kernels.triton.runtime import is_interpreted

    if is_interpreted(matmul_bias_gelu_kernel):
        raise SystemExit("run with TRITON_INTERPRET unset: interpreted kernels cannot be traced")
    # No GPU: what the ops and torch's kernel analysis ask of one, answered for an H100 (132 SMs, sm_90)
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(multi_processor_count=132)
    triton.runtime.driver.set_active(SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
    mode = FakeTensorMode()

    def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        with mode:
            return torch.empty(*shape, dtype=dtype, device="cuda")

    failures = 0
    for label, fn, args in _cases(t):
        op = label.split()[0]
        try:
            calls = [n for n in _graph(fn, args).nodes if n.op == "call_function"]
            ours = {str(n.target) for n in calls if str(n.target).startswith("gpt2_fused.")}
            launches = [n.kwargs for n in calls if "triton_kernel_wrapper_functional" in str(n.target)]
            kernels = [_jit(kernel_side_table.get_kernel(k["kernel_idx"])).__name__ for k in launches]
            if not OPAQUE and op not in ALWAYS_OPAQUE:
                assert kernels and not ours, f"expected the kernels inlined, got {[str(n.target) for n in calls]}"
                for name, k in zip(kernels, launches):
                    copied = set(k["tensors_to_clone"]) - WRITTEN[name]
                    assert not copied, f"{name}: read-only arguments counted as written (copied): {copied}"
            else:
                assert ours == {f"gpt2_fused.{op}.default"} and not kernels, f"expected an opaque call: {calls}"
            print(f"ok   {label}: {'opaque op' if ours else ', '.join(kernels)}", flush=True)
        except Exception:
            failures += 1
            print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
