"""The point-to-point ring all-reduce gives dist.all_reduce's sums (gloo, 2-4 processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.ring_allreduce import ring_all_reduce

SHAPES = [(1,), (3,), (7,), (64,), (1001,), (5, 3)]  # includes lengths below and not divisible by world size


def file_store(tmp_path: Path) -> str:
    """A rendezvous through a file: spawned children import for seconds before they would bind a TCP port picked
    now, and another process could take it meanwhile."""
    return f"file://{tmp_path / 'store'}"


def _worker(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        for i, shape in enumerate(SHAPES):
            for dtype in (torch.float64, torch.float32):
                g = torch.Generator().manual_seed(1000 * rank + i)
                x = torch.randn(shape, generator=g, dtype=dtype)
                expected = x.clone()
                dist.all_reduce(expected)
                got = ring_all_reduce(x)
                assert got is x
                tol = 1e-12 if dtype == torch.float64 else 1e-5
                torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        if world >= 3:  # a sub-group whose ranks are not 0..n-1: peers must be mapped to global ranks
            members = list(range(1, world))
            sub = dist.new_group(members)
            x = torch.full((10,), float(rank), dtype=torch.float64)
            if rank in members:
                ring_all_reduce(x, sub)
                assert torch.equal(x, torch.full((10,), float(sum(members)), dtype=torch.float64))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_all_reduce_matches_all_reduce(world: int, tmp_path):
    mp.spawn(_worker, args=(world, file_store(tmp_path)), nprocs=world, join=True)


def _collectives_worker(rank: int, world: int, store: str, out: str) -> None:
    from benchmarks import collectives

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        collectives.run(collectives.parse_args(["--out", out, "--min-bytes", "4096", "--max-bytes", "16384",
                                                "--bytes-per-point", "1"]))
    finally:
        dist.destroy_process_group()


def test_collectives_benchmark_on_gloo(tmp_path):
    import csv

    mp.spawn(_collectives_worker, args=(2, file_store(tmp_path), str(tmp_path)), nprocs=2, join=True)
    rows = list(csv.DictReader((tmp_path / "collectives_n2.csv").open()))
    factors = {"all_reduce": 1.0, "ring_all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5,
               "all_to_all": 0.5, "broadcast": 1.0}  # nccl-tests bus factors at n = 2
    assert {r["op"] for r in rows} == set(factors) and len(rows) == 3 * len(factors)
    for r in rows:
        assert r["status"] == "ok", r
        algbw = int(r["bytes"]) / (float(r["time_us"]) * 1e-6) / 1e9
        assert float(r["busbw_GBps"]) == pytest.approx(algbw * factors[r["op"]], rel=0.05, abs=2e-3)
    assert (tmp_path / "collectives_n2.png").stat().st_size > 0
    assert "| 4 KB |" in (tmp_path / "ring_vs_nccl_n2.md").read_text()
