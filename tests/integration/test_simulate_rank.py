"""tools.simulate_rank: one rank of an N-rank layout run alone, over parallel/simulated.py's process group."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.simulated import BACKEND, init_simulated, is_simulated
from tests.train_runs import ROOT, TINY_ARGS, train_env

RUN_ARGS = [*TINY_ARGS, "--data", "synthetic", "--max-steps", "2", "--batch-size", "2", "--eval-batches", "1"]


@pytest.fixture
def rank_1_of_4() -> Iterator[dist.ProcessGroup]:
    """This process as rank 1 of a simulated 4-rank world, and its TP-like group of ranks [0, 1]."""
    init_simulated(rank=1, world_size=4)
    try:
        yield dist.new_group([0, 1])
    finally:
        dist.destroy_process_group()


def test_collectives_return_finite_stand_ins_of_the_right_shape(rank_1_of_4: dist.ProcessGroup) -> None:
    group = rank_1_of_4
    assert is_simulated() and dist.get_backend() == BACKEND and dist.get_rank(group) == 1
    local = torch.arange(6.0).view(3, 2)  # [3, 2]
    gathered = torch.full((6, 2), float("nan"))  # [2 * 3, 2]: every slot gets the local input
    dist.all_gather_into_tensor(gathered, local, group=group)
    assert torch.equal(gathered, torch.cat([local, local]))
    slots = [torch.full_like(local, float("nan")) for _ in range(2)]
    dist.all_gather(slots, local, group=group)
    assert all(torch.equal(s, local) for s in slots)
    coalesced = [torch.full((6, 2), float("nan")), torch.full((4,), float("nan"))]
    with dist._coalescing_manager(group=group):  # what FSDP2 and bucketed gathers issue
        dist.all_gather_into_tensor(coalesced[0], local, group=group)
        dist.all_gather_into_tensor(coalesced[1], torch.ones(2), group=group)
    assert torch.equal(coalesced[0], torch.cat([local, local])) and torch.equal(coalesced[1], torch.ones(4))
    functional = torch.ops._c10d_functional  # what a compiled graph calls (sequence parallelism's gathers)
    compiled = functional.wait_tensor(functional.all_gather_into_tensor(local, 2, group.group_name))
    assert torch.equal(compiled, torch.cat([local, local]))
    compiled = functional.wait_tensor(functional.reduce_scatter_tensor(flat_input := torch.arange(8.0), "sum", 2,
                                                                       group.group_name))
    assert torch.equal(compiled, flat_input[4:])
    flat = torch.arange(8.0)  # reduce-scatter: this rank's chunk of the local input
    chunk = torch.full((4,), float("nan"))
    dist.reduce_scatter_tensor(chunk, flat, group=group)
    assert torch.equal(chunk, flat[4:])
    summed = local.clone()  # in place: left as it is
    dist.all_reduce(summed)
    dist.broadcast(summed, src=0)
    assert torch.equal(summed, local)
    received = torch.full((2,), float("nan"))
    dist.recv(received, src=0)
    assert torch.equal(received, torch.zeros(2))
    work = dist.all_reduce(summed, async_op=True)  # a future holding the tensors (what DDP's hook reads)
    assert torch.equal(work.get_future().wait()[0], local)


def test_ddp_and_a_compiled_collective_run_on_it(rank_1_of_4: dist.ProcessGroup) -> None:
    group = rank_1_of_4
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

    def step(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # the group passed in, as TP layers do
        y = x * 2
        comm.all_reduce(y, group, None, "forward")
        return comm.all_gather_last(y, group, None, "forward") + comm.group_size(group)  # [3, 2] -> [3, 4]

    x = torch.arange(6.0).view(3, 2)
    explained = torch._dynamo.explain(step)(x, group)
    assert explained.graph_break_count == 0  # traced as a process group, as NCCL's is
    assert torch.equal(torch.compile(step, backend="eager")(x, group), step(x, group))


def simulate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.simulate_rank", *args], cwd=ROOT, env=train_env(),
                          capture_output=True, text=True, timeout=600)


def only_run(out_dir: Path) -> Path:
    (run_dir,) = [p for p in out_dir.iterdir() if p.is_dir()]
    return run_dir


LAYOUTS = {  # id: (world size, rank, train.py flags)
    "ddp-rank1of2": (2, 1, ["--mode", "baseline"]),
    "zero3-tp2-sp": (4, 0, ["--mode", "hybrid", "--tp-size", "2", "--sequence-parallel"]),
    "fsdp2-tp2-sp-rank3of4": (4, 3, ["--mode", "hybrid", "--zero-engine", "fsdp2", "--tp-size", "2",
                                     "--sequence-parallel"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_mode_runs_and_says_it_is_simulated(tmp_path: Path, layout: str) -> None:
    world, rank, flags = LAYOUTS[layout]
    result = simulate(tmp_path, "--world-size", str(world), "--rank", str(rank), "--",
                      *flags, *RUN_ARGS, "--out-dir", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run(tmp_path / "runs")
    assert run_dir.name.startswith(f"simulated-r{rank}of{world}-")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["simulated"] is True and summary["simulated_rank"] == rank and summary["world_size"] == world
    assert all(summary[k] is not None and summary[k] == summary[k] for k in ("final_loss", "val_loss"))  # finite
    console = (run_dir / "console.log").read_text()
    assert f"SIMULATED rank {rank} of {world}" in console and "summary: SIMULATED" in console
    report = subprocess.run([sys.executable, "-m", "tools.report", str(run_dir), "--out", str(tmp_path / "report")],
                            cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    assert f"[SIMULATED rank {rank} of {world}]" in (tmp_path / "report" / "report.md").read_text()


def test_a_real_run_is_not_labelled(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "train.py", "--mode", "single", *RUN_ARGS, "--out-dir",
                             str(tmp_path / "runs")], cwd=ROOT, env=train_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    run_dir = only_run(tmp_path / "runs")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not {"simulated", "simulated_rank"} & summary.keys()
    assert "SIMULATED" not in (run_dir / "console.log").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--world-size", "1", "--", "--mode", "baseline"], "at least 2 ranks"),
    (["--world-size", "4", "--rank", "4", "--", "--mode", "baseline"], "is not a rank of --world-size 4"),
    (["--world-size", "2", "--", "--mode", "single"], "--mode single has no ranks"),
    (["--world-size", "2", "--", "--mode", "baseline", "--save-dir", "ck"], "--save-dir is not simulated"),
    (["--world-size", "2", "--", "--mode", "baseline", "--resume", "ck/step-000002"], "--resume is not simulated"),
    (["--world-size", "4", "--rank", "1", "--", "--mode", "hybrid"], "simulate --rank 0"),
])
def test_what_one_rank_cannot_run_is_refused_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = simulate(tmp_path, *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
