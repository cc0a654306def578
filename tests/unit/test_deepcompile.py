"""`--compile --compiler deepcompile`: ZeRO-3 under DeepSpeed's DeepCompile, checked without a GPU.

DeepCompile cannot run on CPU: its native op (deepspeed/ops/csrc/compile) is CUDA C++ registered for the CUDA
dispatch key only, and DeepSpeed 0.19.8 registers its passes only where `is_deepcompile_supported()` (torch >= 2.6
and the cuda accelerator). Tried here (DS_ACCELERATOR=cpu, gloo, a 2-layer model under zero.Init, ZeRO-3 with
compile.deepcompile=true): `engine.compile()` JIT-builds that op and fails with
`RuntimeError: Error building extension 'dc'` ... `ATen/cuda/ATenCUDAGeneral.h: fatal error: cuda.h: No such file`.
So the training function of DeepCompile (per-step loss and grad norm vs single) is checked on a GPU only: the last
test here (`-m gpu`) and the parity rows zero3-deepcompile[-wN]. On CPU: the
flag's rules, the DeepSpeed config it writes, the early CPU error, and the parity / sweep rows.
"""

from __future__ import annotations

import os

import pytest
import torch

import train
from gpt2.config.cli import parse_args
from gpt2.config.deepspeed_file import build_ds_config
from gpt2.config.layout import RunLayout, check_deepcompile_runs_here
from gpt2.config.schema import ConfigError
from gpt2.observe.run_logging import wandb_identity
from tools.parity_matrix import matrix, plan
from tools.parity_verdict import config_key
from tools.train_sweep import MODES

DC = ["--mode", "hybrid", "--compile", "--compiler", "deepcompile"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--mode", "hybrid", "--compiler", "deepcompile"], "add --compile"),
        (["--compile", "--compiler", "deepcompile"], "use --mode hybrid (ZeRO-3), or --compiler torch"),
        (["--mode", "baseline", "--compile", "--compiler", "deepcompile"], "use --mode hybrid"),
        ([*DC, "--zero-stage", "1"], "use --zero-stage 3, or --compiler torch with --zero-stage 1"),
        ([*DC, "--tp-size", "2"], "use --tp-size 1, or --compiler torch"),
        ([*DC, "--compile-scope", "blocks"], "drop --compile-scope blocks"),
        ([*DC, "--zero3-fetch", "block"], "drop --zero3-fetch"),
        ([*DC, "--comm-log"], "drop --comm-log"),
    ],
)
def test_deepcompile_rejects_what_it_cannot_do(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_args(argv)
    assert needle in str(exc.value)


def test_deepcompile_is_one_fact_of_the_layout() -> None:
    """Parsed once: the whole model is the scope, the layout says deepcompile (no per-block compile, no leaf
    modules), and records, tags and parity keys name it."""
    cfg = parse_args([*DC, "--model", "gpt2-large", "--compile-scope", "auto"])
    assert (cfg.train.compile, cfg.train.compile_scope, cfg.train.compiler) == (True, "model", "deepcompile")
    assert build_ds_config(RunLayout.resolve(cfg, world_size=1, device="cuda"))["zero_optimization"][
        "stage3_param_persistence_threshold"] == 0  # the default ZeRO config: every parameter partitioned
    layout = RunLayout.resolve(cfg, world_size=1, device="cuda")
    assert layout.deepcompile and layout.compile_scope == "deepcompile" and not layout.zero3_blocks
    assert config_key(cfg.to_dict(), 1) == ("gpt2-large zero3 w1 kernels=none attn=sdpa compile=deepcompile ckpt=off "
                                            "bf16 zprec=autocast")  # no fetch unit: DeepCompile has no gather hooks
    assert "compile-deepcompile" in wandb_identity(cfg)["tags"]
    torch_cfg = parse_args(["--mode", "hybrid", "--compile"])
    torch_layout = RunLayout.resolve(torch_cfg, world_size=1, device="cuda")
    assert not torch_layout.deepcompile and torch_layout.compile_scope == "blocks" and torch_layout.zero3_blocks
    assert "compile=blocks" in config_key(torch_cfg.to_dict(), 1)
    old = torch_cfg.to_dict()
    del old["train"]["compiler"]  # a config.json written before --compiler existed
    assert config_key(old, 1) == config_key(torch_cfg.to_dict(), 1)


def test_deepcompile_writes_the_compile_section_and_keeps_the_zero3_settings(tmp_path) -> None:
    """Same ZeRO-3 keys as eager/torch-compiled ZeRO-3 at any world size (nothing special for one rank), plus
    compile.deepcompile; a file that says otherwise is an error naming both."""
    dc = build_ds_config(RunLayout.resolve(parse_args(DC), world_size=1, device="cuda"))
    eager = build_ds_config(RunLayout.resolve(parse_args(["--mode", "hybrid"]), world_size=1, device="cuda"))
    four = build_ds_config(RunLayout.resolve(parse_args(DC), world_size=4, device="cuda"))
    assert dc["compile"] == {"deepcompile": True} and eager["compile"] == {"deepcompile": False}
    assert dc["zero_optimization"] == eager["zero_optimization"] == four["zero_optimization"]
    assert dc["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert dc["zero_optimization"]["memory_efficient_linear"] is False
    assert dc["torch_autocast"] == eager["torch_autocast"] and dc["torch_autocast"]["enabled"]  # bf16 on CUDA
    assert {k: v for k, v in dc.items() if k not in ("compile",)} == {k: v for k, v in eager.items()
                                                                      if k not in ("compile",)}
    path = tmp_path / "ds.json"
    path.write_text('{"compile": {"deepcompile": true}, "zero_optimization": {"stage": 3}}')
    cfg = parse_args(["--mode", "hybrid", "--ds-config", str(path)])
    with pytest.raises(ConfigError, match="sets compile.deepcompile=true but --compile --compiler deepcompile is "
                                          "not given"):
        build_ds_config(RunLayout.resolve(cfg, world_size=1, device="cuda"))


def test_deepcompile_needs_cuda_and_torch_2_6() -> None:
    with pytest.raises(ConfigError, match="runs on CUDA only"):
        RunLayout.resolve(parse_args(DC), world_size=1, device="cpu")
    with pytest.raises(ConfigError, match="needs torch >= 2.6.*this is torch 2.5.1"):
        check_deepcompile_runs_here("cuda", "2.5.1+cu124")
    check_deepcompile_runs_here("cuda", "2.11.0+cu130")
    check_deepcompile_runs_here("cuda", "2.13.0a0+git1234")


def test_deepcompile_on_cpu_fails_before_data_and_run_folder(tmp_path, monkeypatch, capsys) -> None:
    from tools.common import free_port

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(var, value)
    out = tmp_path / "runs"
    argv = [*DC, "--device", "cpu", "--data-path", str(tmp_path / "missing"), "--out-dir", str(out)]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "--compiler deepcompile runs on CUDA only" in err and "missing" not in err
    assert not out.exists()


def test_parity_and_sweep_rows() -> None:
    """zero3-deepcompile at world size 1 and N (the same ZeRO-3 flags); skipped on CPU with the layout's reason."""
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--data", "synthetic"]
    rows = {row.name: row for row in matrix(4)}
    one, four = rows["zero3-deepcompile"], rows["zero3-deepcompile-w4"]
    assert (one.nproc, four.nproc) == (1, 4) and one.flags == four.flags
    job = plan(one, "gpt2-tiny", common, 8, 2, "cuda")
    assert not job.skip and " compile=deepcompile " in job.key and "--compiler" in job.argv
    assert plan(four, "gpt2-tiny", common, 8, 2, "cuda").key.startswith("gpt2-tiny zero3 w4 ")
    assert "runs on CUDA only" in plan(one, "gpt2-tiny", common, 8, 2, "cpu").skip
    assert MODES["hybrid-deepcompile"].flags == ("--mode", "hybrid", "--compile", "--compiler", "deepcompile")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_zero3_deepcompile_trains_singles_function(tmp_path) -> None:
    """The CPU-impossible half, on a GPU (`pytest -m gpu`): ZeRO-3 under DeepCompile at world size 1 (2-layer gpt2,
    bf16, 8 steps: the compiled graph from step 1, the prefetch/selective-gather re-compile after 5) matches single's
    loss and gradient norm on every step within the bounds of ZeRO-3 --compile (0.02, 5%)."""
    pytest.importorskip("deepspeed")
    from tests.gpu.test_gpu_compile_parity import _max_deltas, _run

    steps = ("--max-steps", "8")
    single = _run(tmp_path, "single", *steps, mode="single")
    dloss, dnorm = _max_deltas(single, _run(tmp_path, "deepcompile", *steps, "--compile", "--compiler", "deepcompile"))
    assert dloss < 0.02 and dnorm < 0.05, (dloss, dnorm)


@pytest.mark.parametrize("deepcompile", [True, False])
def test_deepcompile_evaluates_without_inductors_alignment_assert(deepcompile: bool) -> None:
    """DeepCompile's no-grad graph (GPT-2 Large, H100) died at its first evaluation in Inductor's alignment assert on
    cuDNN attention's undefined logsumexp (pytorch#196226): evaluation compiles with that assert off, under
    DeepCompile only; training, and every other engine, keep it."""
    from types import SimpleNamespace

    from gpt2.engines.deepspeed_engine import DeepSpeedEngine

    asserts_seen: list[bool] = []

    class FakeDeepSpeed:
        def eval(self) -> None: ...

        def train(self) -> None: ...

        def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            asserts_seen.append(torch._inductor.config.alignment_asserts)
            return torch.tensor(2.0), (x == y).sum()

    engine = SimpleNamespace(engine=FakeDeepSpeed(), layout=SimpleNamespace(deepcompile=deepcompile),
                             ctx=SimpleNamespace(device=torch.device("cpu"), distributed=False))
    before = torch._inductor.config.alignment_asserts
    ones = torch.ones(2, 4, dtype=torch.long)
    assert DeepSpeedEngine.evaluate(engine, iter([(ones, ones)])) == (2.0, 1.0)  # type: ignore[arg-type]
    assert asserts_seen == [before and not deepcompile]
    assert torch._inductor.config.alignment_asserts == before


def test_deepspeed_builds_its_op_with_an_arch_list_it_can_parse(monkeypatch):
    """The H100 image sets TORCH_CUDA_ARCH_LIST with `9.0a`, which DeepSpeed's JIT builder cannot parse (the
    first GPU run of DeepCompile failed so); inside the context the suffixes are gone, after it the list is back."""
    from gpt2.engines.deepspeed_engine import arch_list_deepspeed_can_parse

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0a+PTX")
    with arch_list_deepspeed_can_parse():
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0 10.0+PTX"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0a 10.0a+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    with arch_list_deepspeed_can_parse():
        assert "TORCH_CUDA_ARCH_LIST" not in os.environ


def test_deepcompile_scheduler_gets_the_recursion_depth_of_a_long_graph() -> None:
    """DeepSpeed's DeepCompile scheduler recurses once per node of a graph's longest chain; GPT-2 Large's forward has
    1,453 (its first GPU run died of RecursionError). A 5,000-node chain fails at Python's default limit and passes
    at the limit the engine sets."""
    import sys
    import types

    import torch.fx as fx
    from deepspeed.compile.list_schedule import get_node_requirements

    from gpt2.engines.deepspeed_engine import DEEPCOMPILE_RECURSION_LIMIT, DeepSpeedEngine

    graph = fx.Graph()
    node = graph.placeholder("x")
    for _ in range(5_000):
        node = graph.call_function(torch.neg, (node,))
    graph.output(node)
    out = next(iter(graph.find_nodes(op="output")))
    old = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(1_000)
        with pytest.raises(RecursionError):
            get_node_requirements(out, [])
        compiled = types.SimpleNamespace(compile=lambda backend: None, is_deepcompile_active=lambda: True)
        DeepSpeedEngine._deepcompile(types.SimpleNamespace(engine=compiled))  # what the engine does before training
        assert sys.getrecursionlimit() >= DEEPCOMPILE_RECURSION_LIMIT
        assert len(get_node_requirements(out, [])) == 5_002
    finally:
        sys.setrecursionlimit(old)


def test_throughput_warmup_leaves_out_deepcompiles_compiles() -> None:
    """DeepCompile re-compiles after DEEPCOMPILE_RECOMPILE_STEP steps (DeepSpeed's own WARMUP): by default tokens/s
    starts after it; an explicit shorter warm-up is kept (parity runs ask for 0) and warned about (the layout's
    warnings, which the loop logs)."""
    from deepspeed.compile.init_z3 import WARMUP

    from gpt2.config.schema import DEEPCOMPILE_RECOMPILE_STEP, THROUGHPUT_WARMUP_STEPS

    assert DEEPCOMPILE_RECOMPILE_STEP == WARMUP
    assert parse_args(DC).train.throughput_warmup_steps == WARMUP + 1
    assert parse_args(["--mode", "hybrid", "--compile"]).train.throughput_warmup_steps == THROUGHPUT_WARMUP_STEPS
    explicit = parse_args([*DC, "--throughput-warmup-steps", "0", "--max-steps", "10"])
    assert explicit.train.throughput_warmup_steps == 0
    warned = RunLayout.resolve(explicit, world_size=1, device="cuda").warnings(start_step=0)
    assert any("count DeepCompile's second compile" in w for w in warned)
    default = RunLayout.resolve(parse_args([*DC, "--max-steps", "10"]), world_size=1, device="cuda").warnings(0)
    assert not any("DeepCompile" in w for w in default)
