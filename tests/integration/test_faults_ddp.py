"""Fault injection with 2 gloo ranks under torchrun, DDP (`--mode baseline`).

One run is killed at 6 stages of a save (fault_chain.DDP_STAGES: where 2 ranks differ from one process, or the
resume point is decided; all 12 until the single-process chain of tests/integration/test_faults.py killed at every
stage in the suite, each a 2-rank launch) and at 2 random instants (1 of the whole job, 1 of one rank), each time
continued with `--resume auto`; the chain and what it checks after each kill: tests/fault_chain.py. (8, then 4,
random kills until CI had to fit well under 20 minutes: each is one more 2-rank launch; the 2 still fall in either
half of the window, and the three chains' 6 over it.)
A file of its own, so that pytest-xdist (--dist loadfile) runs it beside the other chain.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault_chain import DDP_STAGES, run_chain


@pytest.mark.slow
@pytest.mark.soak
def test_kill_at_6_stages_and_2_random_instants_then_resume_auto_continues(tmp_path: Path) -> None:
    launches = run_chain("ddp", tmp_path, n_random=2, seed=17, stages=DDP_STAGES)
    print(" ".join(f"{launch.fault or 'finish'}:{launch.seconds:.1f}s" for launch in launches))
