"""Ring all-reduce written on point-to-point send/recv: a reduce-scatter phase, then an all-gather.

The flat tensor is cut into n chunks with `tensor_split` (sizes differ by at most one element, so
any length works). Reduce-scatter step k: rank r sends chunk (r - k) mod n to rank r+1 and adds the
chunk (r - k - 1) mod n that arrives from rank r-1; after n-1 steps rank r holds the full sum of
chunk (r + 1) mod n. All-gather step k: rank r forwards chunk (r + 1 - k) mod n and receives chunk
(r - k) mod n straight into place. Each rank sends 2 (n-1)/n of the tensor, the bandwidth-optimal
amount that nccl-tests' all-reduce bus factor assumes. Each step is one `batch_isend_irecv`, so the
send and receive of a step proceed together and NCCL cannot deadlock on their order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int, group: dist.ProcessGroup | None) -> None:
    ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over `group` in place, like `dist.all_reduce(tensor, group=group)`; returns it."""
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor (as dist.all_reduce does)")
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    rank = dist.get_rank(group)
    # P2POp takes global ranks
    to = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    frm = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)  # n contiguous views
    recv_buf = torch.empty_like(chunks[0])  # chunk 0 is the largest

    for k in range(n - 1):  # reduce-scatter
        send_i, recv_i = (rank - k) % n, (rank - k - 1) % n
        recv = recv_buf[: chunks[recv_i].numel()]
        _exchange(chunks[send_i], recv, to, frm, group)
        chunks[recv_i].add_(recv)
    for k in range(n - 1):  # all-gather
        _exchange(chunks[(rank + 1 - k) % n], chunks[(rank - k) % n], to, frm, group)
    return tensor
