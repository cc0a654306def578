"""Launcher variables that cannot make a launch, refused in one line before the rendezvous: a rank outside the
world, or a MASTER_PORT this rank 0 cannot listen on, would otherwise wait for the whole collective timeout (or end
in a socket traceback). Needs no torch: it runs before the process group exists."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping

from gpt2.config.schema import ConfigError


def check_ranks(world_size: int, rank: int, local_rank: int) -> None:
    """RANK and LOCAL_RANK must name a process of a WORLD_SIZE world (ranks 0 .. WORLD_SIZE - 1)."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if value >= world_size:
            raise ConfigError(f"{name}={value} is not below WORLD_SIZE={world_size} (ranks are 0 to {world_size - 1}): "
                              "no launch can complete; correct or unset them, or launch with torchrun")


def check_master_port(env: Mapping[str, str], rank: int) -> None:
    """Rank 0 hosts the rendezvous store on MASTER_PORT unless torchrun's agent hosts it (then the port is the
    agent's, rightly busy): a port another process listens on is refused, naming it."""
    text = env.get("MASTER_PORT")
    if text is None or rank != 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    if not (text.isdigit() and 0 < int(text) < 65536):
        raise ConfigError(f"environment variable MASTER_PORT={text!r} is not a port (1 to 65535); correct or unset it")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's socket: TIME_WAIT is no conflict
        try:
            probe.bind(("", int(text)))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise ConfigError(f"MASTER_PORT={text} is already in use on this host (another run's rendezvous?): pick "
                              "a free port (torchrun --master-port=N, or --standalone picks one)") from None


def check_launcher_values(world_size: int, rank: int, local_rank: int,
                          env: Mapping[str, str] = os.environ) -> None:
    """The launcher variables' values, once they parse as integers (gpt2.runtime.distributed.env_int)."""
    check_ranks(world_size, rank, local_rank)
    check_master_port(env, rank)
