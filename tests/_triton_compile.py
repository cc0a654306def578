"""Compile every Triton kernel of the repo for sm_90 (Hopper) down to a cubin, without a GPU.

Run as `python -m tests._triton_compile` with TRITON_INTERPRET unset: the CPU interpreter accepts code the
GPU compiler rejects (non-constexpr globals, unsupported Python constructs), and `triton.compile` with an
explicit GPUTarget runs the real front end, optimiser, LLVM and ptxas on the CPU. Prints one line per
kernel and exits 1 if any fails. Signatures mirror the launches in fused_kernels/ and benchmarks/gemm/.
"""

from __future__ import annotations

import os
import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def _jit(kernel: object) -> object:
    """The JITFunction under autotune/heuristics wrappers."""
    while isinstance(kernel, triton.runtime.Autotuner | triton.runtime.Heuristics):
        kernel = kernel.fn
    return kernel


def _cases() -> list[tuple[str, object, dict[str, str], dict[str, object], dict[str, int]]]:
    """(label, kernel, runtime-arg types, constexpr values, options) for each launch variant."""
    from benchmarks.gemm.triton_matmul import CONFIGS as GEMM_CONFIGS
    from benchmarks.gemm.triton_matmul import _matmul_kernel
    from fused_kernels.triton.cross_entropy import ce_chunk_kernel
    from fused_kernels.triton.gelu import bias_gelu_bwd_kernel, bias_gelu_fwd_kernel
    from fused_kernels.triton.layernorm import add_layernorm_bwd_kernel, add_layernorm_fwd_kernel
    from fused_kernels.triton.matmul_gelu import _configs, matmul_bias_gelu_kernel

    cases = []
    for has_bias in (True, False):
        bias_t = "*bf16" if has_bias else "constexpr"
        tile = {"HAS_BIAS": has_bias, "BLOCK_M": 4, "BLOCK_N": 1024}
        cases.append((f"bias_gelu_fwd bias={has_bias}", bias_gelu_fwd_kernel,
                      {"x_ptr": "*bf16", "b_ptr": bias_t, "y_ptr": "*bf16", "M": "i32", "N": "i32"},
                      {"b_ptr": None} | tile if not has_bias else tile, {"num_warps": 8}))
        cases.append((f"bias_gelu_bwd bias={has_bias}", bias_gelu_bwd_kernel,
                      {"dy_ptr": "*bf16", "x_ptr": "*bf16", "b_ptr": bias_t, "dx_ptr": "*bf16", "M": "i32", "N": "i32"},
                      {"b_ptr": None} | tile if not has_bias else tile, {"num_warps": 8}))
    for has_res in (True, False):
        sig = {"x_ptr": "*bf16", "res_ptr": "*bf16" if has_res else "constexpr", "w_ptr": "*fp32", "b_ptr": "*fp32",
               "y_ptr": "*fp32", "r_ptr": "*bf16" if has_res else "constexpr", "mean_ptr": "*fp32",
               "rstd_ptr": "*fp32", "M": "i32", "N": "i32", "eps": "fp32"}
        const = {"HAS_RESIDUAL": has_res, "BLOCK_M": 1, "BLOCK_N": 2048} | (
            {} if has_res else {"res_ptr": None, "r_ptr": None})
        cases.append((f"add_layernorm_fwd residual={has_res}", add_layernorm_fwd_kernel, sig, const, {"num_warps": 8}))
        sig = {"dy_ptr": "*fp32", "drout_ptr": "*bf16" if has_res else "constexpr", "r_ptr": "*bf16", "w_ptr": "*fp32",
               "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dr_ptr": "*bf16", "dw_part_ptr": "*fp32",
               "db_part_ptr": "*fp32", "M": "i32", "N": "i32"}
        const = {"HAS_DROUT": has_res, "TILES": 4, "BLOCK_M": 1, "BLOCK_N": 2048} | (
            {} if has_res else {"drout_ptr": None})
        cases.append((f"add_layernorm_bwd drout={has_res}", add_layernorm_bwd_kernel, sig, const, {"num_warps": 8}))
    for grad in (True, False):
        cases.append((f"ce_chunk grad={grad}", ce_chunk_kernel,
                      {"logits_ptr": "*bf16", "targets_ptr": "*i64", "inv_n_ptr": "*fp32", "loss_ptr": "*fp32",
                       "correct_ptr": "*i32", "stride_row": "i64"},
                      {"V": 50257, "V_PADDED": 50304, "COMPUTE_GRAD": grad, "BLOCK_V": 4096}, {"num_warps": 8}))
    mm_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "pre_ptr": "*bf16", "M": "i32",
              "N": "i32"} | {s: "i32" for s in ("stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_ym",
                                                "stride_yn")}
    for cfg in _configs()[:1]:  # the tile sizes do not change what the front end accepts; each costs seconds
        const = {"K": 1280, "HAS_BIAS": True, "STORE_PRE": True, "FP32_PRECISION": "tf32", "DOT_IN_FP32": False,
                 "stride_xk": 1, "stride_wk": 1, "stride_yn": 1} | cfg.kwargs
        cases.append((f"matmul_bias_gelu {cfg.kwargs}", matmul_bias_gelu_kernel, mm_sig, const,
                      {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}))
    gemm_sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"} | {
        s: "i32" for s in ("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")}
    cfg = GEMM_CONFIGS[0]
    cases.append((f"gemm _matmul_kernel {cfg.kwargs}", _matmul_kernel, gemm_sig, dict(cfg.kwargs),
                  {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}))
    return cases


def compile_all() -> list[str]:
    """Compile every case; returns the failures (label and error)."""
    failures = []
    for label, kernel, arg_types, constexprs, options in _cases():
        fn = _jit(kernel)
        signature = {name: arg_types.get(name, "constexpr") for name in fn.arg_names}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options=options)
            print(f"ok   {label}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin", flush=True)
        except Exception as e:  # report every kernel, not just the first failure
            failures.append(f"{label}: {type(e).__name__}: {e}")
            print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
    return failures


if __name__ == "__main__":
    if triton.knobs.runtime.interpret or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run with TRITON_INTERPRET unset: interpreted kernels cannot be compiled")
    sys.exit(1 if compile_all() else 0)
