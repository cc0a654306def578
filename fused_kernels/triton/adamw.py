"""AdamW over many tensors in one Triton launch per parameter group, the clip divisor applied as gradients are read.

torch's fused AdamW (`torch.optim.AdamW(fused=True)`) divides each gradient by `grad_scale` as it reads it and
stores the quotient back: with the clip passed as `grad_scale` (`gpt2.engines.guard.clip_divisor`), the step moves
32 bytes a parameter instead of AdamW's 28. This kernel reads the gradient and never writes it (the engine zeroes
the gradients right after the step), so a clipped step moves 28 bytes a parameter beside the norm's 4.

Many tensors, one launch: each program owns BLOCK elements of one tensor, found through tables of the tensors'
device addresses (parameters, gradients, the two moments, the step counts) and, per program, its tensor's index and
start. The tables of an optimizer's state are built once and kept while every address they hold stays the same;
the gradients' table is copied from the host (8 bytes a tensor) when their addresses differ from the last step's
(autograd allocates gradients anew each step, though often in the same blocks).

    norm = grad_norm(optimizer)
    adamw_step(optimizer, grad_divisor=clip_divisor(norm, 1.0), found_inf=(~torch.isfinite(norm)).float())

`grad_norm` reads the gradients through the same tables, each program summing the squares of its block: the clipped
step's first pass, 4 bytes a parameter, with 16-byte loads where the update has them.

The update is `torch.optim.AdamW`'s (`amsgrad=False`, `maximize=False`), on the optimizer's own state: the same
`exp_avg`, `exp_avg_sq` and per-parameter `step` tensors as its fused implementation keeps, so checkpoints and
`optimizer.step()` can take over from here and back. A step whose `found_inf` is non-zero changes nothing, step
counts included. fp32 parameters only, and the step counts on the parameters' device (fused AdamW's state:
`TritonAdamW` is built fused, so that `load_state_dict` puts them there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from fused_kernels.triton.runtime import is_interpreted

BLOCK = 2048  # elements a program updates: a few vectorised loads of each of its four streams
ALIGNMENT = 16  # bytes: a 16-byte access moves four fp32 elements
Shard = Callable[[torch.Tensor], torch.Tensor]  # a parameter's (or its state's, gradient's) tensor the kernels read
TABLES = "_triton_adamw_tables"  # the optimizer attribute holding each parameter group's _GroupTables
GRAD_TABLES = "_triton_adamw_grad_tables"  # ... and each group's last gradient table: (addresses, device table)
NUM_WARPS = 4  # per program: BLOCK / (32 * NUM_WARPS) elements a thread (docs/decisions.md)


@triton.jit
def adamw_kernel(
    param_addrs, grad_addrs, exp_avg_addrs, exp_avg_sq_addrs, step_addrs, numels, block_tensor, block_start,
    divisor_ptr, found_inf_ptr, lr, beta1, beta2, eps, weight_decay,
    HAS_DIVISOR: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)  # which tensor this program updates
    offs = tl.multiple_of(tl.load(block_start + pid), BLOCK) + tl.arange(0, BLOCK)  # [BLOCK] indices in it
    limit = tl.where(tl.load(found_inf_ptr) == 0, tl.load(numels + t), 0)  # a non-finite step writes nothing
    p_ptr = tl.load(param_addrs + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(grad_addrs + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(exp_avg_addrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(exp_avg_sq_addrs + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # addresses read from a table carry no alignment: without the hints every access is 4 bytes wide
        limit = tl.multiple_of(limit, 4)  # elements: ALIGNMENT // 4
        p_ptr = tl.multiple_of(p_ptr, 16)  # bytes: ALIGNMENT
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    mask = offs < limit
    step = tl.load(tl.load(step_addrs + t).to(tl.pointer_type(tl.float32)))  # already counts this step
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if HAS_DIVISOR:
        g = g / tl.load(divisor_ptr)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * weight_decay)  # decoupled weight decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))  # 1 - beta1^step
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    p = p - (lr / bias_correction1) * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


@triton.jit
def sum_squares_kernel(grad_addrs, numels, block_tensor, block_start, out, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    offs = tl.multiple_of(tl.load(block_start + pid), BLOCK) + tl.arange(0, BLOCK)  # [BLOCK]
    limit = tl.load(numels + t)
    g_ptr = tl.load(grad_addrs + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # as in adamw_kernel
        limit = tl.multiple_of(limit, 4)
        g_ptr = tl.multiple_of(g_ptr, 16)
    g = tl.load(g_ptr + offs, mask=offs < limit, other=0.0)
    tl.store(out + pid, tl.sum(g * g, axis=0))  # this block's sum of squares


def _addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return _table([t.data_ptr() for t in tensors], device)


def _table(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[n] on `device`. From pinned memory: a copy from pageable memory waits for the stream's work so far, and the
    gradients' table may be copied while the backward still runs."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _aligned(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor starts on, and spans whole, ALIGNMENT-byte words: the kernel's vector-width hints."""
    return all(t.data_ptr() % ALIGNMENT == 0 and t.numel() * t.element_size() % ALIGNMENT == 0 for t in tensors)


@dataclass(frozen=True)
class _GroupTables:
    """One parameter group's launch: which parameters and state it was built for, and the device tables of what does
    not move between steps."""

    param_ids: tuple[int, ...]
    addresses: tuple[int, ...]  # what the tables were built for: `_addresses_of`
    param_addrs: torch.Tensor  # [n] int64
    exp_avg_addrs: torch.Tensor  # [n] int64
    exp_avg_sq_addrs: torch.Tensor  # [n] int64
    step_addrs: torch.Tensor  # [n] int64
    numels: torch.Tensor  # [n] int64
    block_tensor: torch.Tensor  # [programs] int32: each program's tensor
    block_start: torch.Tensor  # [programs] int64: its first element
    aligned: bool  # parameters and state, by `_aligned`

    @classmethod
    def build(cls, params: list[torch.nn.Parameter], state: dict, shard: Shard) -> _GroupTables:
        device = params[0].device
        weights = [shard(p) for p in params]
        blocks = [(i, start) for i, w in enumerate(weights) for start in range(0, w.numel(), BLOCK)]
        exp_avgs = [shard(state[p]["exp_avg"]) for p in params]
        exp_avg_sqs = [shard(state[p]["exp_avg_sq"]) for p in params]
        steps = [state[p]["step"] for p in params]
        assert all(t.device == device and t.dtype == torch.float32 for t in steps), (
            "step counts must be float32 on the parameters' device (fused AdamW's state)")
        return cls(tuple(map(id, params)), _addresses_of(params, state, shard), _addresses(weights, device),
                   _addresses(exp_avgs, device), _addresses(exp_avg_sqs, device), _addresses(steps, device),
                   _table([w.numel() for w in weights], device),
                   _table([i for i, _ in blocks], device, torch.int32),
                   _table([s for _, s in blocks], device),
                   _aligned([*weights, *exp_avgs, *exp_avg_sqs]))


def _addresses_of(params: list[torch.nn.Parameter], state: dict, shard: Shard) -> tuple[int, ...]:
    """Every address a group's tables hold: each parameter's (its shard's), its moments' and its step count's. A
    parameter whose storage was swapped (`.data =`, `load_state_dict(assign=True)`, FSDP2 resharding) or a state
    tensor replaced changes it."""
    return tuple(a for p in params for a in (shard(p).data_ptr(), shard(state[p]["exp_avg"]).data_ptr(),
                                             shard(state[p]["exp_avg_sq"]).data_ptr(), state[p]["step"].data_ptr()))


def _init_state(optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter]) -> None:
    """The state torch's fused AdamW creates at a parameter's first step (a float32 step count on the device)."""
    for p in params:
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _tables(optimizer: torch.optim.AdamW, group_index: int, params: list[torch.nn.Parameter],
            shard: Shard) -> _GroupTables:
    """The group's tables, rebuilt when its parameters, or any address the tables hold, are not those they were
    built for (a first step, a loaded state dict, a parameter's storage swapped)."""
    cache: dict[int, _GroupTables] = optimizer.__dict__.setdefault(TABLES, {})
    tables = cache.get(group_index)
    if (tables is None or tables.param_ids != tuple(map(id, params))
            or tables.addresses != _addresses_of(params, optimizer.state, shard)):
        tables = cache[group_index] = _GroupTables.build(params, optimizer.state, shard)
    return tables


def _stepped_groups(optimizer: torch.optim.AdamW,
                    shard: Shard) -> list[tuple[int, dict, list[torch.nn.Parameter], _GroupTables]]:
    """Each group with a gradient: its index, the group, its parameters that have one (torch's AdamW leaves the others
    out) and their tables (the state created first, as torch's fused AdamW creates it at a parameter's first step)."""
    stepped = []
    for index, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params), "fp32 only"
            _init_state(optimizer, params)
            stepped.append((index, group, params, _tables(optimizer, index, params, shard)))
    return stepped


def _grad_table(optimizer: torch.optim.AdamW, group_index: int, params: list[torch.nn.Parameter],
                shard: Shard) -> tuple[list[torch.Tensor], torch.Tensor, bool]:
    """The gradients as the kernels read them (contiguous, each the shape of its parameter: the group's table checked
    the numels; the caller holds the list until its launch), their device address table, and whether all of
    them allow the 16-byte hints. The table is copied to the device only when the addresses changed since the
    group's last table: the norm and the update of a step read the same gradients, and the caching allocator often
    hands a step's gradients the previous step's blocks."""
    grads = [shard(p.grad).contiguous() for p in params]
    addrs = tuple(g.data_ptr() for g in grads)
    cache: dict[int, tuple[tuple[int, ...], torch.Tensor]] = optimizer.__dict__.setdefault(GRAD_TABLES, {})
    last = cache.get(group_index)
    if last is None or last[0] != addrs:
        last = cache[group_index] = (addrs, _table(list(addrs), params[0].device))
    return grads, last[1], all(a % ALIGNMENT == 0 for a in addrs)


def _launch_options(kernel: object) -> dict[str, int]:
    return {"num_warps": 1 if is_interpreted(kernel) else NUM_WARPS}


def _unsharded(t: torch.Tensor) -> torch.Tensor:
    return t


def _device(optimizer: torch.optim.AdamW) -> torch.device:
    """The device of the optimizer's parameters (its first one, whichever group holds it)."""
    return next(p for group in optimizer.param_groups for p in group["params"]).device


def grad_norm(optimizer: torch.optim.AdamW, shard: Shard = _unsharded) -> torch.Tensor:
    """The L2 norm (an fp32 device scalar) of the gradients `adamw_step` would read (with `shard`, of this rank's
    shards: the caller reduces sharded norms): one launch per group writes each block's sum of squares, then one
    sum over the blocks (a fixed order: deterministic). Like a first `adamw_step`, it creates the optimizer's state
    where a parameter has none (its tables point at the moments)."""
    partials = []
    for index, _, params, tables in _stepped_groups(optimizer, shard):
        grads, grad_addrs, grads_aligned = _grad_table(optimizer, index, params, shard)  # grads: held until launched
        out = torch.empty(tables.block_tensor.numel(), dtype=torch.float32, device=params[0].device)  # [programs]
        sum_squares_kernel[(out.numel(),)](grad_addrs, tables.numels, tables.block_tensor, tables.block_start, out,
                                           ALIGNED=tables.aligned and grads_aligned, BLOCK=BLOCK,
                                           **_launch_options(sum_squares_kernel))
        partials.append(out)
    if not partials:
        return torch.zeros((), dtype=torch.float32, device=_device(optimizer))
    return torch.cat(partials).sum().sqrt()  # [sum of programs] -> []


def adamw_step(optimizer: torch.optim.AdamW, grad_divisor: torch.Tensor | None, found_inf: torch.Tensor,
               shard: Shard = _unsharded) -> None:
    """One `optimizer.step()` of torch's AdamW, each gradient divided by `grad_divisor` (a device scalar; None: 1)
    as it is read, skipped on the device where `found_inf` (a device scalar) is non-zero. Parameters without a
    gradient are left out, as torch's AdamW leaves them. `shard`: the tensor of a parameter (and of its gradient and
    moments) the update runs on, e.g. a DTensor's local shard (AdamW is elementwise: the shard's update is the
    parameter's); the state itself stays what the optimizer holds."""
    for index, group, params, tables in _stepped_groups(optimizer, shard):
        assert not group["amsgrad"] and not group["maximize"], "adamw_step: plain AdamW only"
        steps = [optimizer.state[p]["step"] for p in params]
        # counts this step unless it is skipped; one addend a tensor: a single device-tensor addend is read with
        # .item() (a host sync every step)
        torch._foreach_add_(steps, [1.0 - found_inf] * len(steps))
        grads, grad_addrs, grads_aligned = _grad_table(optimizer, index, params, shard)  # grads: held until launched
        beta1, beta2 = group["betas"]
        adamw_kernel[(tables.block_tensor.numel(),)](
            tables.param_addrs, grad_addrs, tables.exp_avg_addrs, tables.exp_avg_sq_addrs,
            tables.step_addrs, tables.numels, tables.block_tensor, tables.block_start, grad_divisor, found_inf,
            float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], HAS_DIVISOR=grad_divisor is not None,
            ALIGNED=tables.aligned and grads_aligned, BLOCK=BLOCK, **_launch_options(adamw_kernel))


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW (its state, hyperparameters and checkpoints) whose `step()` is `adamw_step`. Like torch's fused
    AdamW, the step reads the optimizer's `grad_scale` (the divisor) and `found_inf` attributes where a caller set
    them (`gpt2.engines.guard.step_if_finite`). `shard`: as in `adamw_step`; the other arguments are AdamW's. Built
    fused (torch's fused state: `load_state_dict` puts the step counts on the parameters' device as float32, where
    the kernel reads them) unless told otherwise."""

    def __init__(self, params: Any, *, shard: Shard = _unsharded, **adamw: Any):
        super().__init__(params, **{"fused": True, **adamw})
        self.shard = shard

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        assert closure is None, "TritonAdamW.step takes no closure"
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            found_inf = torch.zeros((), dtype=torch.float32, device=_device(self))
        adamw_step(self, getattr(self, "grad_scale", None), found_inf, shard=self.shard)

    def grad_norm(self) -> torch.Tensor:
        """`grad_norm` of this optimizer's gradients (of their shards)."""
        return grad_norm(self, self.shard)
