"""Each TP collective and layer, forward and every gradient, against the plain layer on the full tensors.

One process group per world size runs every check. Tolerances: exact where the parallel
computation does the same arithmetic (lookups, gathers, splits, argmax), fp32 1e-6 where a sum is
split over ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fused_kernels import REFERENCE_OPS
from parallel import comm
from parallel.comm import CommStats
from parallel.dims import ParallelDims
from parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
from parallel.loss import vocab_parallel_cross_entropy
from parallel.tp_plan import Shard, shard_tensor, unshard_tensor
from tests._tp_harness import device, spawn

B, T, D_IN, D_OUT = 2, 8, 12, 16
F32 = 4
COLLECTIVES = (comm.copy_to_tp, comm.reduce_from_tp, comm.gather_from_tp, comm.scatter_to_tp,
               comm.gather_from_sequence, comm.reduce_scatter_to_sequence, comm.scatter_to_sequence)


def close(actual: torch.Tensor, expected: torch.Tensor, exact: bool = False, what: str = "") -> None:
    tol = 0.0 if exact else 1e-6
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}" if what else m)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device())


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def check_collectives(dims: ParallelDims) -> None:
    g, r, n = dims.tp_group, dims.tp_rank, dims.tp_size
    stats = CommStats()
    x_full = randn(B, T, D_IN, seed=1)
    up = randn(B, T, D_IN, seed=2)  # upstream gradient of the full tensor

    # f: identity forward, all-reduce backward (every rank's upstream gradient differs: rank-scaled)
    x = leaf(x_full)
    y = comm.copy_to_tp(x, g, stats)
    close(y, x_full, exact=True)
    (y * up * (r + 1)).sum().backward()
    close(x.grad, up * sum(range(1, n + 1)))
    assert stats.bytes[("all_reduce", "bwd")] == B * T * D_IN * F32

    # g: all-reduce forward, identity backward; never mutates its input
    x = leaf(x_full * (r + 1))
    y = comm.reduce_from_tp(x, g, stats)
    close(x, x_full * (r + 1), exact=True)
    close(y, x_full * sum(range(1, n + 1)))
    (y * up).sum().backward()
    close(x.grad, up, exact=True)

    # last-dim gather / scatter are each other's backward
    x = leaf(x_full.chunk(n, dim=-1)[r])
    y = comm.gather_from_tp(x, g, stats)
    close(y, x_full, exact=True)
    (y * up).sum().backward()
    close(x.grad, up.chunk(n, dim=-1)[r], exact=True)
    x = leaf(x_full)
    y = comm.scatter_to_tp(x, g, stats)
    close(y, x_full.chunk(n, dim=-1)[r], exact=True)
    (y * up.chunk(n, dim=-1)[r]).sum().backward()
    close(x.grad, up, exact=True)

    # sequence (dim 1) all-gather <-> reduce-scatter, and the communication-free split
    x = leaf(x_full.chunk(n, dim=1)[r])
    y = comm.gather_from_sequence(x, g, stats)
    close(y, x_full, exact=True)
    (y * up * (r + 1)).sum().backward()
    close(x.grad, (up * sum(range(1, n + 1))).chunk(n, dim=1)[r])
    x = leaf(x_full * (r + 1))
    y = comm.reduce_scatter_to_sequence(x, g, stats)
    close(y, (x_full * sum(range(1, n + 1))).chunk(n, dim=1)[r])
    (y * up.chunk(n, dim=1)[r]).sum().backward()
    close(x.grad, up, exact=True)
    x = leaf(x_full)
    y = comm.scatter_to_sequence(x, g, stats)
    close(y, x_full.chunk(n, dim=1)[r], exact=True)
    (y * up.chunk(n, dim=1)[r]).sum().backward()
    close(x.grad, up, exact=True)

    full = B * T * D_IN * F32
    assert dict(stats.bytes) == {
        ("all_reduce", "bwd"): full, ("all_reduce", "fwd"): full,
        ("all_gather", "fwd"): 2 * full, ("all_gather", "bwd"): 3 * full,
        ("reduce_scatter", "bwd"): full, ("reduce_scatter", "fwd"): full,
    }, stats.bytes

    # one-rank groups: every collective is the identity and records nothing
    solo = dist.new_group([dims.rank], use_local_synchronization=True)
    quiet = CommStats()
    for fn in COLLECTIVES:
        assert fn(x_full, solo, quiet) is x_full
    assert not quiet.bytes


def check_collectives_compiled(dims: ParallelDims) -> None:
    """Each collective compiled (Dynamo + AOT autograd, one graph) gives eager's output and input gradient.

    torch 2.11's Dynamo fed the backward of a Function whose output was last written in place (reduce_from_tp's
    all-reduce, reduce_scatter_to_sequence's reduce-scatter) zeros instead of the incoming gradient
    (pytorch/pytorch#184113): TP under --compile trained another function while eager matched single."""
    g, r = dims.tp_group, dims.tp_rank
    x_full = randn(B, T, D_IN, seed=6) * (r + 1)  # rank-dependent, as partial sums are
    for op in COLLECTIVES:
        def loss_of(x: torch.Tensor, up: torch.Tensor, op=op) -> tuple[torch.Tensor, torch.Tensor]:
            y = op(x * 1.0, g)  # a non-leaf input, as inside a block
            return y, (y * up).sum()

        x = leaf(x_full)
        y, _ = loss_of(x, torch.zeros(()))
        up = randn(*y.shape, seed=7) * (r + 1)  # every element's gradient differs, and every rank's
        loss_of(x, up)[1].backward()
        torch._dynamo.reset()
        x_c = leaf(x_full)
        y_c, loss = torch.compile(loss_of, backend="aot_eager", fullgraph=True)(x_c, up)
        loss.backward()
        close(y_c, y, exact=True, what=f"compiled {op.__name__}")
        close(x_c.grad, x.grad, exact=True, what=f"compiled {op.__name__}'s input gradient")


def check_shard_roundtrip(dims: ParallelDims) -> None:
    n = dims.tp_size
    w = randn(3 * D_OUT, D_IN, seed=3)
    for spec in (Shard(0), Shard(1), Shard(0, blocks=3), Shard(None)):
        shards = [shard_tensor(w, spec, r, n) for r in range(n)]
        close(unshard_tensor(shards, spec), w, exact=True)
    q, k, v = w.chunk(3)  # the fused [q|k|v] layout: each rank gets [q_r | k_r | v_r]
    close(shard_tensor(w, Shard(0, blocks=3), 1, n), torch.cat([t.chunk(n)[1] for t in (q, k, v)]), exact=True)


def check_column(dims: ParallelDims) -> None:
    g, r, n = dims.tp_group, dims.tp_rank, dims.tp_size
    ref = nn.Linear(D_IN, D_OUT).to(device())
    x_full, up = randn(B, T, D_IN, seed=4), randn(B, T, D_OUT, seed=5)
    for gelu in (False, True):
        x_ref = leaf(x_full)
        ref.zero_grad()
        y_ref = ref(x_ref)
        y_ref = F.gelu(y_ref, approximate="tanh") if gelu else y_ref
        (y_ref * up).sum().backward()
        for sp in (False, True):
            for overlap in (False, True):
                stats = CommStats()
                layer = ColumnParallelLinear(shard_tensor(ref.weight, Shard(0), r, n),
                                             shard_tensor(ref.bias, Shard(0), r, n), REFERENCE_OPS, g,
                                             sequence_parallel=sp, overlap=overlap, stats=stats)
                x = leaf(x_full.chunk(n, dim=1)[r] if sp else x_full)
                y = layer(x, gelu=gelu)  # [B, T, D_OUT/tp]
                close(y, y_ref.chunk(n, dim=-1)[r])
                (y * up.chunk(n, dim=-1)[r]).sum().backward()
                close(x.grad, x_ref.grad.chunk(n, dim=1)[r] if sp else x_ref.grad)
                close(layer.weight.grad, ref.weight.grad.chunk(n, dim=0)[r])
                close(layer.bias.grad, ref.bias.grad.chunk(n)[r])
                act = B * T * D_IN * F32
                fused = overlap and not gelu  # the overlapped path recomputes the SP all-gather in backward
                want = ({("all_gather", "fwd"): act, ("reduce_scatter", "bwd"): act} if sp
                        else {("all_reduce", "bwd"): act})
                if sp and fused:
                    want[("all_gather", "bwd")] = act
                assert dict(stats.bytes) == want, (gelu, sp, overlap, stats.bytes)


def check_column_autocast(dims: ParallelDims) -> None:
    """Under bf16 autocast the column layer communicates bf16 activations and still matches nn.Linear."""
    g, r, n = dims.tp_group, dims.tp_rank, dims.tp_size
    dev = device()
    ref = nn.Linear(D_IN, D_OUT).to(dev)
    x_full, up = randn(B, T, D_IN, seed=15), randn(B, T, D_OUT, seed=16)
    x_ref = leaf(x_full)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        y_ref = ref(x_ref)
    (y_ref.float() * up).sum().backward()
    bf16 = dict(rtol=2e-2, atol=2e-2)
    for sp in (False, True):
        for overlap in (False, True):
            stats = CommStats()
            w, b = shard_tensor(ref.weight, Shard(0), r, n), shard_tensor(ref.bias, Shard(0), r, n)
            layer = ColumnParallelLinear(w, b, REFERENCE_OPS, g, sequence_parallel=sp, overlap=overlap, stats=stats)
            x = leaf(x_full.chunk(n, dim=1)[r] if sp else x_full)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                y = layer(x)
            assert y.dtype == torch.bfloat16
            torch.testing.assert_close(y, y_ref.chunk(n, dim=-1)[r], **bf16)
            (y.float() * up.chunk(n, dim=-1)[r]).sum().backward()
            assert x.grad.dtype == layer.weight.grad.dtype == torch.float32
            torch.testing.assert_close(x.grad, x_ref.grad.chunk(n, dim=1)[r] if sp else x_ref.grad, **bf16)
            torch.testing.assert_close(layer.weight.grad, ref.weight.grad.chunk(n)[r], **bf16)
            torch.testing.assert_close(layer.bias.grad, ref.bias.grad.chunk(n)[r], **bf16)
            act = B * T * D_IN * 2  # bf16 on the wire
            assert stats.bytes[("all_gather" if sp else "all_reduce", "fwd" if sp else "bwd")] == act, stats.bytes


def check_row(dims: ParallelDims) -> None:
    g, r, n = dims.tp_group, dims.tp_rank, dims.tp_size
    ref = nn.Linear(D_IN * n, D_OUT).to(device())
    nn.init.normal_(ref.bias)
    x_full, up = randn(B, T, D_IN * n, seed=6), randn(B, T, D_OUT, seed=7)
    x_ref = leaf(x_full)
    y_ref = ref(x_ref)
    (y_ref * up).sum().backward()
    for sp in (False, True):
        stats = CommStats()
        layer = RowParallelLinear(shard_tensor(ref.weight, Shard(1), r, n), ref.bias.detach().clone(),
                                  REFERENCE_OPS, g, sequence_parallel=sp, stats=stats)
        x = leaf(x_full.chunk(n, dim=-1)[r])
        y = layer(x)
        close(y, y_ref.chunk(n, dim=1)[r] if sp else y_ref)
        (y * (up.chunk(n, dim=1)[r] if sp else up)).sum().backward()
        close(x.grad, x_ref.grad.chunk(n, dim=-1)[r])
        close(layer.weight.grad, ref.weight.grad.chunk(n, dim=1)[r])
        bias_grad = layer.bias.grad.clone()
        if sp:  # each rank saw only its tokens: the sum over ranks is the full gradient
            dist.all_reduce(bias_grad, group=g)
        close(bias_grad, ref.bias.grad)
        out = B * T * D_OUT * F32
        want = ({("reduce_scatter", "fwd"): out, ("all_gather", "bwd"): out} if sp else {("all_reduce", "fwd"): out})
        assert dict(stats.bytes) == want, (sp, stats.bytes)
    with pytest.raises(ValueError, match="GELU"):
        layer(x, gelu=True)


def check_embedding(dims: ParallelDims) -> None:
    g, r, n = dims.tp_group, dims.tp_rank, dims.tp_size
    V = 8 * n
    ref = nn.Embedding(V, D_OUT).to(device())
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(8)).to(device())
    up = randn(B, T, D_OUT, seed=9)
    y_ref = ref(idx)
    (y_ref * up).sum().backward()
    for sp in (False, True):
        layer = VocabParallelEmbedding(shard_tensor(ref.weight, Shard(0), r, n), r * V // n, g, sequence_parallel=sp)
        y = layer(idx)
        close(y, y_ref.chunk(n, dim=1)[r] if sp else y_ref, exact=True)
        (y * (up.chunk(n, dim=1)[r] if sp else up)).sum().backward()
        close(layer.weight.grad, ref.weight.grad.chunk(n)[r], exact=True)


def check_cross_entropy(dims: ParallelDims) -> None:
    """Against F.cross_entropy / argmax on the full logits, with vocab padding, ignored targets and ties."""
    g, r, n = dims.tp_group, dims.tp_rank, dims.tp_size
    N, V_pad = 24, 16 * n
    V = V_pad - 5  # the last 5 columns are padding and must never matter
    logits_full = randn(N, V_pad, seed=10) * 3
    logits_full[:, V:] = 100.0  # padding that would dominate if it were not masked
    targets = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(11)).to(device())
    targets[::5] = -100
    targets[1::4] = logits_full[1::4, :V].argmax(-1)  # some correct predictions
    logits_full[2, [1, V_pad // n + 1]] = 50.0  # a tie across two ranks' shards: the smaller index wins
    targets[2] = 1
    logits_full[3, [V_pad // n + 2, V - 1]] = 50.0  # a tie where the target is the later index: wrong
    targets[3] = V - 1

    ref_logits = leaf(logits_full)
    ref_loss = F.cross_entropy(ref_logits[:, :V], targets, ignore_index=-100)
    ref_correct = (ref_logits[:, :V].argmax(-1) == targets).sum()
    ref_loss.backward()

    stats = CommStats()
    logits = leaf(logits_full.chunk(n, dim=-1)[r])
    loss, correct = vocab_parallel_cross_entropy(logits, targets, r * V_pad // n, V, g, stats)
    close(loss, ref_loss)
    assert correct.item() == ref_correct.item() and correct.dtype == torch.long
    loss.backward()
    close(logits.grad, ref_logits.grad.chunk(n, dim=-1)[r])
    assert stats.bytes[("all_reduce", "fwd")] == 3 * N * F32 + N * 8  # max, sum-exp, target logit, argmax


def check_lm_head(dims: ParallelDims) -> None:
    """The tied head (sharing the vocab-parallel embedding's Parameter) against gpt2.model.gpt.LMHead."""
    from gpt2.model.gpt import LMHead

    g, r, n = dims.tp_group, dims.tp_rank, dims.tp_size
    V_pad, V = 8 * n, 8 * n - 3
    weight = nn.Parameter(randn(V_pad, D_IN, seed=12))
    ref = LMHead(weight, V, REFERENCE_OPS)
    hidden_full = randn(B, T, D_IN, seed=13)
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(14)).to(device())
    h_ref = leaf(hidden_full)
    ref_loss, ref_correct = ref(h_ref, targets)
    ref_loss.backward()
    with torch.no_grad():
        ref_logits = ref(hidden_full, None)
    for sp in (False, True):
        for overlap in (False, True):
            emb = VocabParallelEmbedding(shard_tensor(weight, Shard(0), r, n), r * V_pad // n, g)
            head = VocabParallelLMHead(emb.weight, emb.vocab_start, V, REFERENCE_OPS, g,
                                       sequence_parallel=sp, overlap=overlap)
            h = leaf(hidden_full.chunk(n, dim=1)[r] if sp else hidden_full)
            loss, correct = head(h, targets)
            close(loss, ref_loss)
            assert correct.item() == ref_correct.item()
            loss.backward()
            close(h.grad, h_ref.grad.chunk(n, dim=1)[r] if sp else h_ref.grad)
            close(emb.weight.grad, weight.grad.chunk(n)[r])
            with torch.no_grad():
                close(head(h, None), ref_logits)  # [B, T, V]: the inference path gathers the vocabulary


def run_layer_checks(dims: ParallelDims) -> None:
    torch.manual_seed(0)
    check_collectives(dims)
    check_collectives_compiled(dims)
    check_shard_roundtrip(dims)
    check_column(dims)
    check_column_autocast(dims)
    check_row(dims)
    check_embedding(dims)
    check_cross_entropy(dims)
    check_lm_head(dims)


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4)])
def test_tp_layers_match_full_layers(world: int, tp: int):
    spawn(run_layer_checks, world, tp)
