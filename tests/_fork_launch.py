"""A train.py launcher for the CPU suite that forks its ranks from an interpreter that has already imported torch.

Every launch of tests/train_runs.run_train used to start fresh interpreters: torchrun (its agent imports torch,
~1.5 CPU-s) and one train.py per rank, each importing torch, Dynamo, DTensor and the harness (~3.4 CPU-s) and, under
DeepSpeed, deepspeed and the Inductor that DeepSpeed's Muon check imports in deepspeed.initialize (~2 CPU-s more). On
the 2-core CI machine those imports were about half of the suite's launch time. This server (one per pytest worker
and flavour, started on first use) imports them once; each launch forks its ranks from it, and every rank runs
train.py as `python train.py` would (runpy as __main__, the request's environment, its own stdout/stderr files, exit
through train.py's own os._exit), under the variables torchrun's agent sets, the agent's TCPStore included
(TORCHELASTIC_USE_AGENT_STORE: the server binds port 0 after forking, so no port is picked beforehand).

Fork safety: the server runs no tensor op and starts no thread before forking (one thread, checked at start-up);
each rank reseeds Python's `random` (a fresh interpreter seeds it from the OS). What a fork cannot give: every rank
of a launch shares the server's str hash seed (fresh interpreters each draw their own). Launches that need a fresh
interpreter (custom environments: run_train(env=...); the launcher, signal and soak tests, which start their own
processes) do not come here; GPT2_TEST_FORK=0 runs every launch as before.

Protocol: one JSON request a line on stdin, one JSON answer a line on stdout.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import sys
import threading
import time
import traceback

PDEATHSIG = 1  # prctl(PR_SET_PDEATHSIG): a rank dies with the server


def preload(flavour: str) -> None:
    """Import what every train.py rank imports (and, flavour 'deepspeed', what a DeepSpeed rank adds): imports only,
    no op run."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import gpt2.data.loader  # noqa: F401
    import gpt2.engines.build  # noqa: F401
    import gpt2.observe.run_logging  # noqa: F401
    import gpt2.planning.planner  # noqa: F401
    import gpt2.runtime.distributed  # noqa: F401
    import gpt2.train.checkpoint  # noqa: F401
    import gpt2.train.loop  # noqa: F401
    import train  # noqa: F401

    if flavour == "deepspeed":
        import deepspeed  # noqa: F401
        import deepspeed.accelerator  # noqa: F401
        import deepspeed.comm  # noqa: F401
        import deepspeed.ops.op_builder.cpu  # noqa: F401
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (deepspeed.initialize imports it)


PROTOCOL_FD: int | None = None  # the server's answers (its stdout, moved off fd 1, which is stderr's copy)


def _rank(req: dict, env: dict[str, str], port_fd: int) -> None:
    """In the forked rank: wait for the store's port, become `python train.py ARGS`, never return."""
    status = 1
    try:
        if PROTOCOL_FD is not None:
            os.close(PROTOCOL_FD)
        ctypes.CDLL(None).prctl(PDEATHSIG, signal.SIGKILL)
        port = os.read(port_fd, 64).decode().strip()
        os.close(port_fd)
        if port:
            env["MASTER_PORT"] = port
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req["cwd"])
        _reseed()
        script = req["script"]
        sys.argv = [script, *req["args"]]
        sys.path[0] = os.path.dirname(script)
        import runpy

        runpy.run_path(script, run_name="__main__")  # train.py leaves through os._exit
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _reseed() -> None:
    """The random states a fresh interpreter draws from the OS (Python's, numpy's global one, torch's default
    generator's initial seed): forked ranks would otherwise share the server's."""
    import numpy as np
    import torch

    random.seed()
    np.random.seed()
    torch.seed()


def launch(req: dict) -> dict:
    from torch.distributed import TCPStore

    nproc = req["nproc"]
    deadline = time.monotonic() + 10
    while len(os.listdir("/proc/self/task")) > 1:  # the last launch's store thread has ended: fork from one thread
        assert time.monotonic() < deadline, "the fork server still runs a thread of its last launch"
        time.sleep(0.01)
    pids, writers = [], []
    for rank in range(nproc):
        env = dict(req["env"])
        if nproc > 1:  # what torchrun's local agent sets (torch.distributed.elastic local_elastic_agent)
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                       LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
                       ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", TORCHELASTIC_RESTART_COUNT="0",
                       TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="True",
                       TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            for fd in writers:
                os.close(fd)
            os.close(w)
            _rank(req, env, r)
        os.close(r)
        pids.append(pid)
        writers.append(w)
    store = None
    if nproc > 1:  # forked first: the store's thread starts after the last fork
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for w in writers:
        os.write(w, f"{store.port if store else ''}\n".encode())
        os.close(w)
    codes: dict[int, int] = {}
    deadline, timed_out = time.monotonic() + req["timeout"], False
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0:  # torchrun stops the other ranks when one fails
                _kill([p for p in pids if p not in codes])
            continue
        if time.monotonic() > deadline:
            timed_out = True
            _kill([p for p in pids if p not in codes])
        time.sleep(0.02)
    del store
    ranks = [codes[p] for p in pids]
    failed = [c for c in ranks if c != 0]
    rc = 0 if not failed else (ranks[0] if nproc == 1 else 1)  # torchrun exits 1 when a worker failed
    return {"rc": rc, "ranks": ranks, "timed_out": timed_out}


def _kill(pids: list[int]) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def serve(flavour: str) -> None:
    global PROTOCOL_FD
    PROTOCOL_FD = os.dup(1)  # answers only: what the imports print goes to stderr
    os.dup2(2, 1)
    out = os.fdopen(PROTOCOL_FD, "w")
    preload(flavour)
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1 and threading.active_count() == 1, f"{threads} threads before forking"
    out.write(json.dumps({"ready": flavour}) + "\n")
    out.flush()
    for line in sys.stdin:
        out.write(json.dumps(launch(json.loads(line))) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
