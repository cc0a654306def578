"""A process group whose collectives move nothing: one rank of an N-rank layout run alone on one device.

Every collective returns at once with finite, deterministic data of the right shape, dtype and device, as if every
peer held this rank's data: in-place collectives (all-reduce, broadcast, reduce) leave their tensors as they are,
gathers fill every slot with the local input, reduce-scatters and scatters return this rank's chunk of the local
input, all-to-all returns the input in place of the peers' pieces, a receive returns zeros. So every mode trains to
the end (DDP's communication hook gets a future holding its tensors; sequence parallelism's gathers hold real
activations), and the rank's compute, memory and host path are those of the layout, while its values, and therefore
its losses, are not: a simulated run carries no parity verdict and no throughput of the layout.

The group is a Python `ProcessGroup` over torch's own fake backend (C++). The all-gathers go straight to that backend,
which fills every slot with the local input as above (torch >= 2.11), at the host cost of a C++ call: under sequence
parallelism they are half a step's collectives. The rest are Python methods here, where the fake backend does not
answer as above (torch 2.11 leaves a reduce-scatter's output unwritten; DDP's hook needs a future holding tensors):
one Python call each, microseconds of host time that NCCL's C++ path does not spend. Compiled collectives
(functional collectives, resolved by the group's name) reach the same methods. Each collective is recorded as
`c10d::<collective>` (the C++ ones by the dispatcher, the Python ones here) so that `--profile` counts collective
calls as it does for NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup, _create_work_from_future
from torch.futures import Future
from torch.profiler import record_function

BACKEND = "simulated"
DEVICES = ("cpu", "cuda")


def _done(tensors: list[torch.Tensor]) -> dist.Work:
    """A finished Work whose future holds `tensors` (what DDP's communication hook reads)."""
    future: Future = Future()
    future.set_result(tensors)
    return _create_work_from_future(future)


def _recorded(name: str) -> Callable[[Callable[..., list[torch.Tensor]]], Callable[..., dist.Work]]:
    """A collective's body, run under a profiler label, returning a finished Work over what the body returns."""
    def wrap(body: Callable[..., list[torch.Tensor]]) -> Callable[..., dist.Work]:
        def collective(self: SimulatedProcessGroup, *args: Any, **options: Any) -> dist.Work:
            with record_function(f"c10d::{name}"):  # options (reduce op, root, timeout) change nothing here
                return _done(body(self, *args))
        collective.__name__ = body.__name__
        return collective
    return wrap


class SimulatedProcessGroup(dist.ProcessGroup):
    """Collectives as if every peer held this rank's tensors (the module docstring says what each returns)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size

    def _own_chunk(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.chunk(self._size)[self._rank]

    def getBackendName(self) -> str:  # noqa: N802 (ProcessGroup's name)
        return BACKEND

    # in place: the tensors already hold "the result"
    def _untouched(self, tensors: list[torch.Tensor], *opts: Any) -> list[torch.Tensor]:
        return tensors

    allreduce = _recorded("allreduce_")(_untouched)
    allreduce_coalesced = _recorded("allreduce_coalesced_")(_untouched)
    broadcast = _recorded("broadcast_")(_untouched)
    reduce = _recorded("reduce_")(_untouched)

    @_recorded("barrier")
    def barrier(self, *opts: Any) -> list[torch.Tensor]:
        return []

    # all-gathers: not here; the fake backend beneath fills every slot with the local input (module docstring)

    @_recorded("gather_")
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], *opts: Any) -> list[torch.Tensor]:
        for slots, local in zip(outputs, inputs):  # a non-root rank has no slots
            for slot in slots:
                slot.copy_(local)
        return [t for slots in outputs for t in slots]

    # reduce-scatters and scatters: this rank's chunk of the local input
    @_recorded("reduce_scatter_")
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], *opts: Any
                       ) -> list[torch.Tensor]:
        for output, pieces in zip(outputs, inputs, strict=True):
            output.copy_(pieces[self._rank])
        return outputs

    @_recorded("_reduce_scatter_base_")
    def _reduce_scatter_base(self, output: torch.Tensor, flat: torch.Tensor, *opts: Any) -> list[torch.Tensor]:
        output.copy_(self._own_chunk(flat))  # flat: [size * n, ...] -> output: [n, ...]
        return [output]

    @_recorded("reduce_scatter_tensor_coalesced_")
    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *opts: Any
                                        ) -> list[torch.Tensor]:
        for output, flat in zip(outputs, inputs, strict=True):
            output.copy_(self._own_chunk(flat))
        return outputs

    @_recorded("scatter_")
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], *opts: Any
                ) -> list[torch.Tensor]:
        for output, pieces in zip(outputs, inputs or [[]] * len(outputs)):
            output.copy_(pieces[self._rank]) if pieces else output.zero_()  # a non-root rank has no inputs
        return outputs

    # all-to-all: the local input stands in for the peers' pieces
    @_recorded("alltoall_base_")
    def alltoall_base(self, output: torch.Tensor, local: torch.Tensor, *args: Any) -> list[torch.Tensor]:
        output.copy_(local)
        return [output]

    @_recorded("alltoall_")
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *opts: Any) -> list[torch.Tensor]:
        for output, local in zip(outputs, inputs, strict=True):
            output.copy_(local)
        return outputs

    # point to point: nothing arrives
    @_recorded("send")
    def send(self, tensors: list[torch.Tensor], *args: Any) -> list[torch.Tensor]:
        return tensors

    @_recorded("recv_")
    def recv(self, tensors: list[torch.Tensor], *args: Any) -> list[torch.Tensor]:
        for t in tensors:
            t.zero_()
        return tensors

    # torch 2.13 names of the flat collectives (2.11 calls the underscored ones above)
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *opts: Any
                                        ) -> dist.Work:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs)


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> SimulatedProcessGroup:
    group = SimulatedProcessGroup(rank, size)
    # a backend beneath the group carries the name c10d gives it (functional collectives look groups up by name)
    # and answers the collectives the class does not define (the all-gathers)
    named = FakeProcessGroup._create_internal(rank, size)
    for device in DEVICES:
        group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, named)
    return group


def _traced_as_a_process_group() -> None:
    """torch 2.11's Dynamo knows a process group by its exact type: a collective on a subclass would break the
    compiled graph where NCCL's group does not (2.13 traces the subclass as it is)."""
    try:
        from torch._dynamo.variables.distributed import ProcessGroupVariable
    except ImportError:
        return
    exact_type = ProcessGroupVariable.is_process_group

    def is_process_group(value: object) -> bool:
        return isinstance(value, SimulatedProcessGroup) or exact_type(value)

    ProcessGroupVariable.is_process_group = staticmethod(is_process_group)


def register() -> None:
    """Make `simulated` a torch.distributed backend (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=list(DEVICES))
        _traced_as_a_process_group()


def init_simulated(rank: int, world_size: int) -> None:
    """The default process group of this process: rank `rank` of `world_size`, every peer simulated."""
    register()
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=dist.HashStore())


def is_simulated(group: dist.ProcessGroup | None = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_backend(group) == BACKEND
