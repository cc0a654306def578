"""The suite's launcher (tests/_fork_launch.py, through tests/train_runs.fork_server): forked ranks get what torchrun
gives fresh ones (its variables, a gloo group through the agent's store, their own random states, their own
stdout/stderr), and a failing rank ends the launch at once with torchrun's status."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.train_runs import fork_server

SCRIPT = """
import json, os, random, sys
import numpy as np
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EXTRA")
record = {"env": {k: os.environ.get(k) for k in keys}, "sum": total.item(), "argv": sys.argv[1:],
          "cwd": os.getcwd(), "main": __name__, "draws": [random.random(), float(np.random.rand()),
                                                        torch.initial_seed()]}
with open(sys.argv[1] + f"/rank{rank}.json", "w") as f:
    json.dump(record, f)
print(f"out of rank {rank}")
print(f"err of rank {rank}", file=sys.stderr)
if len(sys.argv) > 2 and rank == 1:
    raise SystemExit(3)
if len(sys.argv) > 2:
    import time
    time.sleep(120)  # rank 0 of the failing launch waits: the launcher must end it
dist.destroy_process_group()
"""


def test_forked_ranks_are_launched_as_torchrun_launches_them(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    server = fork_server("base")
    out, err = tmp_path / "out", tmp_path / "err"
    result = server.launch([str(tmp_path)], 2, 60, out, err, {"EXTRA": "x"}, script=script)
    assert result == {"rc": 0, "ranks": [0, 0], "timed_out": False}, err.read_text()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, record in enumerate(ranks):
        env = record["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["EXTRA"]) == (
            str(r), str(r), "2", "2", "x")
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert record["sum"] == 3.0 and record["argv"] == [str(tmp_path)] and record["main"] == "__main__"
    assert ranks[0]["cwd"] == ranks[1]["cwd"] == str(Path(__file__).resolve().parents[2])
    for a, b in zip(ranks[0]["draws"], ranks[1]["draws"]):
        assert a != b  # Python's, numpy's and torch's random states: each rank its own, as fresh interpreters
    for r in range(2):  # both ranks' lines in each file (they may interleave, as under torchrun's shared stdout)
        assert f"out of rank {r}" in out.read_text() and f"err of rank {r}" in err.read_text()
        assert f"out of rank {r}" not in err.read_text() and f"err of rank {r}" not in out.read_text()

    t0 = time.monotonic()
    failed = server.launch([str(tmp_path), "fail"], 2, 60, out, err, script=script)
    assert (failed["rc"], failed["ranks"][1], failed["timed_out"]) == (1, 3, False)  # torchrun exits 1
    assert failed["ranks"][0] == -9 and time.monotonic() - t0 < 30  # the waiting rank was ended, not waited for


def test_a_launch_interrupted_mid_way_cannot_answer_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest-timeout (or Ctrl-C) can interrupt a test while it waits for a launch's answer: the server, which would
    still send that answer to whoever asks next, is killed, and the next launch gets a new server and its own answer."""
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    server = fork_server("base")
    out, err = tmp_path / "out", tmp_path / "err"

    def interrupted() -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(server.proc.stdout, "readline", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.launch([str(tmp_path), "fail"], 2, 60, out, err, script=script)
    monkeypatch.undo()
    assert server.proc.wait(timeout=10) != 0  # killed: its answer to the interrupted launch goes nowhere
    fresh = fork_server("base")
    assert fresh is not server
    assert fresh.launch([str(tmp_path)], 2, 60, out, err, script=script) == {"rc": 0, "ranks": [0, 0],
                                                                               "timed_out": False}
