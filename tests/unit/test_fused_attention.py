"""--attn: every choice computes causal attention; flash is a clear error without flash-attn; a forced SDPA kernel
holds under torch.compile; `auto` picks the fastest kernel that passes the accuracy probe (fake timings here, the
real ones on a GPU) and on CPU trains exactly like sdpa; the SDPA backend probe names a real kernel."""

from __future__ import annotations

import importlib.util
import math
from typing import get_args

import pytest
import torch
from torch.nn.attention import SDPBackend

from fused_kernels import KernelUnavailableError
from fused_kernels.attention import (
    AUTO_TOLERANCE,
    SDPA_BACKENDS,
    AttentionShape,
    choose_sdpa_backend,
    get_attention,
    make_sdpa_backend_attention,
    probe_error,
    resolve_attention,
    sdpa_attention,
    sdpa_backend_used,
)
from gpt2.config.schema import AttnChoice
from tests.train_runs import REFERENCE_ARGS, REFERENCE_BATCH, run_train, step_values, summary

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def _causal_attention_fp64(q, k, v):
    """softmax(q k^T / sqrt(hd) + causal mask) v, in fp64. q, k, v: [B, H, T, hd]."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, T, T]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def test_sdpa_is_causal_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16) for _ in range(3))
    torch.testing.assert_close(get_attention("sdpa")(q, k, v, 0.0).double(), _causal_attention_fp64(q, k, v),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash-attn is installed")
def test_flash_without_package_is_a_clear_error():
    with pytest.raises(KernelUnavailableError, match="flash-attn"):
        get_attention("flash")


def test_unknown_attention_is_an_error():
    with pytest.raises(KernelUnavailableError, match="choose one of sdpa, auto"):
        get_attention("paged")


def test_cli_choices_are_the_attention_choices():
    from fused_kernels.attention import ATTN_CHOICES

    assert set(get_args(AttnChoice)) == set(ATTN_CHOICES)


@pytest.mark.parametrize("name", ["sdpa-flash", "sdpa-math", "auto"])
def test_cpu_attention_choices_are_causal_attention(name):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16) for _ in range(3))
    torch.testing.assert_close(get_attention(name)(q, k, v, 0.0).double(), _causal_attention_fp64(q, k, v),
                               atol=1e-5, rtol=1e-5)


def _cpu_shape(dtype=torch.float32, dropout_p=0.0):
    return AttentionShape(2, 3, 40, 16, dtype, torch.device("cpu"), dropout_p)


def test_forced_cuda_kernel_on_cpu_is_an_error():
    with pytest.raises(KernelUnavailableError, match="needs a CUDA GPU"):
        resolve_attention("sdpa-cudnn", _cpu_shape())


def test_auto_on_cpu_is_plain_sdpa_and_sdpa_reports_pytorchs_pick():
    auto = resolve_attention("auto", _cpu_shape())
    assert (auto.backend, auto.fn, auto.timings_ms) == ("sdpa", sdpa_attention, {})
    assert auto.describe() == "auto -> sdpa"
    assert resolve_attention("sdpa", _cpu_shape()).backend in ("sdpa-flash", "sdpa-math")
    assert resolve_attention("sdpa").backend == "sdpa"  # no shape: nothing probed


def _fake(errors: dict[str, float | Exception], times: dict[str, float]):
    """error and timer callables for choose_sdpa_backend that look the candidate up by its kernel."""

    def name_of(fn):
        backend = fn.__closure__[0].cell_contents  # make_sdpa_backend_attention's backend
        return next(n for n, b in SDPA_BACKENDS.items() if b == backend)

    def error(fn, shape):
        e = errors.get(name_of(fn), 0.0)
        if isinstance(e, Exception):
            raise e
        return e

    return error, lambda fn, shape: times[name_of(fn)]


def test_auto_picks_the_fastest_accurate_kernel():
    shape = _cpu_shape(torch.bfloat16)
    error, timer = _fake({"sdpa-cudnn": 0.5, "sdpa-efficient": 1e-3,
                          "sdpa-flash": RuntimeError("No available kernel.\nmore")},
                         {"sdpa-flash": 0.5, "sdpa-cudnn": 0.8, "sdpa-efficient": 1.2})
    choice = choose_sdpa_backend(shape, timer=timer, error=error)
    # flash (fastest) cannot run, cuDNN (next) is inaccurate: the memory-efficient kernel, though slowest
    assert choice.backend == "sdpa-efficient" and choice.timings_ms == {"sdpa-efficient": 1.2}
    assert choice.rejected == {"sdpa-cudnn": f"max error 5.00e-01 > {AUTO_TOLERANCE[torch.bfloat16]:.0e}",
                               "sdpa-flash": "RuntimeError: No available kernel."}
    assert choice.describe() == ("auto -> sdpa-efficient (sdpa-efficient 1.200 ms; rejected sdpa-flash: RuntimeError: "
                                 "No available kernel.; rejected sdpa-cudnn: max error 5.00e-01 > 3e-02)")
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with pytest.raises(RuntimeError):  # on CPU the chosen (CUDA-only) kernel cannot run: it really is forced
        choice.fn(q, k, v, 0.0)

    error, timer = _fake({}, {"sdpa-flash": 0.9, "sdpa-cudnn": 0.7, "sdpa-efficient": 1.0})
    assert choose_sdpa_backend(shape, timer=timer, error=error).backend == "sdpa-cudnn"
    error, timer = _fake({"sdpa-flash": float("nan")}, {"sdpa-flash": 0.1, "sdpa-cudnn": 0.7, "sdpa-efficient": 1.0})
    assert choose_sdpa_backend(shape, timer=timer, error=error).backend == "sdpa-cudnn"  # NaN is not accurate


def test_auto_without_an_accepted_kernel_is_plain_sdpa():
    error, timer = _fake({n: RuntimeError("no") for n in SDPA_BACKENDS}, {})
    choice = choose_sdpa_backend(_cpu_shape(), timer=timer, error=error)
    assert (choice.backend, choice.fn) == ("sdpa", sdpa_attention)
    assert set(choice.rejected) == {"sdpa-flash", "sdpa-cudnn", "sdpa-efficient"}


def test_auto_with_real_probe_and_timer_on_cpu():
    """The real accuracy probe and timer, on the kernels CPU has (flash and math; cuDNN and efficient refuse, and
    CPU flash refuses dropout: a kernel must take the training dropout)."""
    for dtype in (torch.float32, torch.bfloat16):
        choice = choose_sdpa_backend(_cpu_shape(dtype), candidates=("sdpa-flash", "sdpa-math", "sdpa-efficient"))
        assert set(choice.timings_ms) == {"sdpa-flash", "sdpa-math"}, choice.describe()
        assert choice.backend in ("sdpa-flash", "sdpa-math") and all(t > 0 for t in choice.timings_ms.values())
        assert list(choice.rejected) == ["sdpa-efficient"]
    with_dropout = choose_sdpa_backend(_cpu_shape(dropout_p=0.1), candidates=("sdpa-flash", "sdpa-math"))
    assert with_dropout.backend == "sdpa-math" and "No available kernel" in with_dropout.rejected["sdpa-flash"]


def test_probe_error_catches_a_wrong_kernel():
    shape = _cpu_shape(torch.bfloat16)

    def not_causal(q, k, v, dropout_p):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def no_scale(q, k, v, dropout_p):
        return sdpa_attention(q * q.shape[-1] ** 0.5, k, v, dropout_p)

    assert probe_error(make_sdpa_backend_attention(SDPBackend.MATH), shape) < 1e-2
    assert probe_error(make_sdpa_backend_attention(SDPBackend.FLASH_ATTENTION), shape) < 1e-2
    for wrong in (not_causal, no_scale):
        assert probe_error(wrong, shape) > 10 * AUTO_TOLERANCE[torch.bfloat16]


def test_rank0_choice_replaces_the_local_one():
    error, timer = _fake({}, {"sdpa-flash": 0.9, "sdpa-cudnn": 0.7, "sdpa-efficient": 1.0})
    mine = choose_sdpa_backend(_cpu_shape(), timer=timer, error=error)
    theirs = mine.with_backend("sdpa-flash")
    assert theirs.backend == "sdpa-flash" and theirs.fn.__closure__[0].cell_contents == SDPBackend.FLASH_ATTENTION
    assert mine.with_backend("sdpa-cudnn") is mine
    assert mine.with_backend("sdpa").fn is sdpa_attention


@pytest.mark.parametrize(("name", "op"), [("sdpa-math", None), ("sdpa-flash", "_scaled_dot_product_flash_attention")])
def test_forced_kernel_holds_under_torch_compile(name, op):
    """The sdpa_kernel context inside the attention function is traced by Dynamo (fullgraph: no graph break): the
    compiled forward holds the forced kernel's op, the math kernel's decomposition otherwise."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    recorder = AotEagerAndRecordGraphs()
    fn = torch.compile(get_attention(name), backend=recorder, fullgraph=True)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    out = fn(q, k, v, 0.0)
    out.sum().backward()
    torch.testing.assert_close(out.double(), _causal_attention_fp64(q, k, v), atol=1e-5, rtol=1e-5)
    graph = "\n".join(g.code for g in recorder.fw_graphs)
    if op is None:
        assert "scaled_dot_product" not in graph and "softmax" in graph, graph
    else:
        assert op in graph, graph
    torch._dynamo.reset()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU check (two train.py runs): the CPU suite runs it")
def test_auto_on_cpu_trains_exactly_like_sdpa(single_reference, tmp_path):
    run_train(REFERENCE_ARGS + ["--batch-size", str(REFERENCE_BATCH), "--run-name", "auto", "--attn", "auto"],
              tmp_path)
    for key in ("loss", "grad_norm"):
        assert step_values(tmp_path / "auto", key) == step_values(single_reference.run_dir, key)
    got, ref = summary(tmp_path / "auto"), summary(single_reference.run_dir)
    assert (got["attn"], got["attn_backend"], got["attn_choice"]) == ("auto", "sdpa", "auto -> sdpa")
    assert ref["attn"] == "sdpa" and ref["attn_backend"] in ("sdpa-flash", "sdpa-math")
    assert ref["whole_mlp_op"] is False  # the summary says whether the MLP ran as one fused op


# the aten op F.scaled_dot_product_attention dispatches to, per backend
SDPA_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION",
            "aten::_scaled_dot_product_flash_attention": "FLASH_ATTENTION",
            "aten::_scaled_dot_product_cudnn_attention": "CUDNN_ATTENTION",
            "aten::_scaled_dot_product_efficient_attention": "EFFICIENT_ATTENTION",
            "aten::_scaled_dot_product_attention_math": "MATH"}


def profiled_sdpa_backend(shape: tuple[int, ...], dtype: torch.dtype, device: str, dropout_p: float) -> str:
    """The backend that actually ran: the SDPA kernel op in a profile of one causal attention call."""
    q = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    with torch.profiler.profile() as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True)
    (ran,) = {SDPA_OPS[e.key] for e in prof.key_averages() if e.key in SDPA_OPS}
    return ran


@pytest.mark.parametrize("dtype,dropout_p", [(torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.bfloat16, 0.1)])
def test_sdpa_backend_probe_names_what_runs_cpu(dtype, dropout_p):
    shape = (2, 3, 37, 16)
    assert sdpa_backend_used(shape, dtype, "cpu", dropout_p) == profiled_sdpa_backend(shape, dtype, "cpu", dropout_p)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sdpa_backend_probe_names_what_runs_gpu():
    """At GPT-2 Large's shape: on an H100 with torch 2.11 cuDNN runs, though the listed priority order puts flash
    first (a probe walking that list once labelled these runs sdpa-flash)."""
    shape = (8, 20, 1024, 64)
    assert sdpa_backend_used(shape, torch.bfloat16, "cuda") == profiled_sdpa_backend(shape, torch.bfloat16, "cuda", 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_FLASH_ATTN), reason="needs a GPU and flash-attn")
def test_flash_matches_reference():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 129, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = get_attention("flash")(q, k, v, 0.0)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), _causal_attention_fp64(q, k, v), atol=2e-2, rtol=2e-2)


GPT2_LARGE_ATTN = AttentionShape(8, 20, 1024, 64, torch.bfloat16, torch.device("cuda"), 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_gpu_picks_a_fused_kernel_at_gpt2_large_shape():
    choice = resolve_attention("auto", GPT2_LARGE_ATTN)
    print(choice.describe())
    assert choice.backend in ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient"), choice.describe()
    assert choice.timings_ms[choice.backend] == min(choice.timings_ms.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math"])
def test_forced_kernels_on_gpu_match_the_reference(name):
    try:
        choice = resolve_attention(name, GPT2_LARGE_ATTN)
    except KernelUnavailableError as e:
        pytest.skip(str(e))
    err = probe_error(choice.fn, GPT2_LARGE_ATTN)
    assert err <= AUTO_TOLERANCE[torch.bfloat16], (name, err)
    compiled = torch.compile(choice.fn, fullgraph=True)  # the forced kernel under Inductor
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = compiled(q, k, v, 0.0)
    out.sum().backward()
    torch.testing.assert_close(out.double(), _causal_attention_fp64(q, k, v), atol=2e-2, rtol=2e-2)


def test_attention_shape_is_the_ranks_local_heads():
    """Under TP (± sequence parallelism) each rank's attention sees n_head / tp heads and the whole sequence; q/k/v
    arrive in the autocast dtype (CPU runs are fp32)."""
    from gpt2.config.cli import parse_args
    from gpt2.config.layout import RunLayout
    from gpt2.runtime.parallelize import attention_shape

    args = ["--model", "gpt2-large", "--batch-size", "8", "--seq-len", "1024", "--dropout", "0.1"]
    layout = RunLayout.resolve(parse_args(args + ["--mode", "baseline", "--tp-size", "4", "--sequence-parallel"]),
                               world_size=4, device="cuda")
    shape = attention_shape(layout, torch.device("cuda"))
    assert (shape.dims, shape.dtype, shape.dropout_p) == ((8, 5, 1024, 64), torch.bfloat16, 0.1)
    single = attention_shape(RunLayout.resolve(parse_args(args), world_size=1, device="cpu"), torch.device("cpu"))
    assert (single.dims, single.dtype) == ((8, 20, 1024, 64), torch.float32)
