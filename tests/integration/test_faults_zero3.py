"""Fault injection with 2 gloo ranks under torchrun, ZeRO-3 (`--mode hybrid --zero-stage 3`), DeepSpeed's and FSDP2's
(`--zero-engine fsdp2`: its torch.distributed.checkpoint folders inside the same save protocol).

One run is killed at every stage of a save and at 2 random instants (1 of the whole job, 1 of one rank), each
time continued with `--resume auto`; the chain and what it checks after each kill: tests/fault_chain.py. (8, then 4,
random kills until CI had to fit well under 20 minutes: each is one more 2-rank launch; the 2 still fall in either
half of the window, and the three chains' 6 over it.)
A file of its own, so that pytest-xdist (--dist loadfile) runs it beside the other chain.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault_chain import run_chain


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.parametrize(("engine", "seed"), [("zero3", 17), ("fsdp2", 19)])  # fsdp2: --zero-engine fsdp2's DCP files
def test_kill_at_every_stage_and_2_random_instants_then_resume_auto_continues(tmp_path: Path, engine: str,
                                                                               seed: int) -> None:
    launches = run_chain(engine, tmp_path, n_random=2, seed=seed)
    print(" ".join(f"{launch.fault or 'finish'}:{launch.seconds:.1f}s" for launch in launches))
