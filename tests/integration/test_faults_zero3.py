"""Fault injection with 2 gloo ranks under torchrun, ZeRO-3 (`--mode hybrid --zero-stage 3`), DeepSpeed's and FSDP2's
(`--zero-engine fsdp2`: its torch.distributed.checkpoint folders inside the same save protocol).

One run is killed at 3 stages of a save and at 2 random instants (1 of the whole job, 1 of one rank: inside a
step, the engine's save or a prune), each time continued with `--resume auto`; the chain and what it checks after
each kill: tests/fault_chain.py. The stages (fault_chain.ENGINE_STAGES): rank-state-written and
model-state-written (every rank dies, its `.tmp` folder without or with the engine's state) and pruned (the save
done: the next launch loads the engine's checkpoint). The other 9 stages are rank 0's prepare and commit (meta,
manifest, pointers, rename, prune: the same code and files for every engine), which the DDP chain
(test_faults_ddp.py) kills at with 2 ranks: 9 launches fewer per engine here, to keep CI well under 20 minutes.
(8, then 4, random kills until then: each is one more 2-rank launch; the 2 still fall in either half of the window,
and the three chains' 6 over it.)
A file of its own, so that pytest-xdist (--dist loadfile) runs it beside the other chain.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault_chain import ENGINE_STAGES, run_chain


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.parametrize(("engine", "seed"), [("zero3", 17), ("fsdp2", 19)])  # fsdp2: --zero-engine fsdp2's DCP files
def test_kill_at_3_stages_and_2_random_instants_then_resume_auto_continues(tmp_path: Path, engine: str,
                                                                            seed: int) -> None:
    launches = run_chain(engine, tmp_path, n_random=2, seed=seed, stages=ENGINE_STAGES)
    print(" ".join(f"{launch.fault or 'finish'}:{launch.seconds:.1f}s" for launch in launches))
