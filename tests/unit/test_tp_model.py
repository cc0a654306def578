"""The whole TP GPT-2 against the single-device model built from the same seed.

For every (sequence parallel, overlap) combination, on TP=2 and TP=4 (plus TP=2 x DP=2 on 4 ranks):
logits, loss, top-1 count and every gradient (fp32, 1e-5), the state-dict shard/gather round trip,
the parameter marks, a few clipped AdamW steps that must keep the gradient norms and losses equal,
and the per-step communication bytes against the analytical count; then activation checkpointing, the
triton fused-kernel backend (interpreted on CPU), bf16 autocast, and on TP=2 x DP=2 DDP over the DP group. One
process group per layout runs every combination.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fused_kernels import REFERENCE_OPS, KernelOps, get_ops
from gpt2.config.schema import ModelConfig
from gpt2.model.gpt import GPT
from parallel.comm import CommStats
from parallel.dims import ParallelDims
from parallel.grads import allreduce_sequence_parallel_grads, clip_grad_norm_, register_sequence_parallel_grad_hooks
from parallel.tp_plan import apply_tensor_parallel, gather_state_dict, param_shard, shard_state_dict, unshard_tensor
from tests._tp_harness import device, spawn

CFG = ModelConfig(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=250)  # padded to 256
B, T, SEED = 2, 16, 1234
F32 = 4
TOL = dict(rtol=1e-5, atol=1e-5)


def build(dims: ParallelDims | None = None, ops: KernelOps = REFERENCE_OPS, **tp) -> GPT:
    torch.manual_seed(SEED)
    model = GPT(CFG, ops=ops)  # on the CPU, from the seed, as the engine builds it
    if dims is not None:
        apply_tensor_parallel(model, dims, **tp)
    return model.to(device())


def batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dp_rank)  # TP ranks share a batch; DP replicas differ
    idx = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    targets[0, :3] = -100
    return idx.to(device()), targets.to(device())


def full_grads(model: GPT, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """Every gradient of the TP model in the single-device layout (all-gathered over the TP group)."""
    out = {}
    for name, p in model.named_parameters():
        spec = param_shard(name)
        if spec.dim is None:
            out[name] = p.grad
            continue
        shards = [torch.empty_like(p.grad) for _ in range(dims.tp_size)]
        dist.all_gather(shards, p.grad.contiguous(), group=dims.tp_group)
        out[name] = unshard_tensor(shards, spec)
    return out


def expected_bytes(sp: bool, overlap: bool) -> dict[tuple[str, str], int]:
    """One training forward + backward. Without SP: 4 all-reduces of B*T*d per layer, plus the embedding
    output (fwd) and the LM-head input gradient (bwd); with SP each becomes an all-gather or a
    reduce-scatter of the same B*T*d tensor. The vocab-parallel loss adds 3 fp32 + 1 int64 values per token."""
    L, act, N = CFG.n_layer, B * T * CFG.n_embd * F32, B * T
    loss = 3 * N * F32 + N * 8
    if not sp:
        return {("all_reduce", "fwd"): (2 * L + 1) * act + loss, ("all_reduce", "bwd"): (2 * L + 1) * act}
    return {
        ("all_reduce", "fwd"): loss,
        ("reduce_scatter", "fwd"): (2 * L + 1) * act,  # attn/MLP outputs, embedding
        ("all_gather", "fwd"): (2 * L + 1) * act,  # c_attn/c_fc inputs, LM-head input
        ("reduce_scatter", "bwd"): (2 * L + 1) * act,
        # row-output and embedding gradients, the position-embedding gradient [T, d], and with overlap
        # the recomputed inputs of c_attn and the LM head (c_fc applies GELU through ops.linear instead)
        ("all_gather", "bwd"): (2 * L + 1) * act + T * CFG.n_embd * F32 + (L + 1) * act * overlap,
    }


def check_mode(dims: ParallelDims, ref: GPT, ref_grads: dict, ref_logits: torch.Tensor,
               ref_out: tuple, sp: bool, overlap: bool, hooks: bool) -> None:
    tag = f"tp={dims.tp_size} sp={sp} overlap={overlap} hooks={hooks}"
    stats = CommStats()
    model = build(dims, sequence_parallel=sp, overlap=overlap, stats=stats)

    # the TP layout is exactly the single-device weights, cut by the plan
    full = gather_state_dict(model, dims)
    assert full.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=0, msg=f"{tag} gather {k}")
    sharded = shard_state_dict(ref.state_dict(), dims.tp_rank, dims.tp_size)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(sharded[k], v, rtol=0, atol=0, msg=f"{tag} shard {k}")

    idx, targets = batch(dims.dp_rank)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref_logits, **TOL, msg=f"{tag} logits")
    stats.reset()
    if hooks:
        register_sequence_parallel_grad_hooks(model, dims, stats)
    loss, correct = model(idx, targets)
    loss.backward()
    if not hooks:
        allreduce_sequence_parallel_grads(model, dims, stats)
    torch.testing.assert_close(loss, ref_out[0], **TOL, msg=f"{tag} loss")
    assert correct.item() == ref_out[1].item(), tag
    grads = full_grads(model, dims)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=f"{tag} grad {name}")

    step_bytes = {k: v for k, v in stats.bytes.items() if k[1] != "grad"}
    assert step_bytes == expected_bytes(sp, overlap), (tag, dict(stats.bytes))
    sp_params = (6 * CFG.n_layer + 2) * CFG.n_embd  # ln_1, ln_2 (w, b), both row biases; ln_f (w, b)
    assert stats.bytes[("all_reduce", "grad")] == sp_params * F32 * sp, tag
    assert stats.calls[("all_reduce", "grad")] == (0 if not sp else 6 * CFG.n_layer + 2 if hooks else 1), tag

    sharded = {n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    assert sharded == {n for n in ref_grads if param_shard(n).dim is not None}, tag
    marked_sp = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    assert len(marked_sp) == (6 * CFG.n_layer + 2) * sp, tag

    # a few clipped optimizer steps on both models: the functions stay the same
    ref_copy = build()
    ref_copy.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref_copy.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt_ref.zero_grad(set_to_none=True)
        ref_copy(idx, targets)[0].backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_copy.parameters(), max_norm=0.5)
        opt_ref.step()
        opt.zero_grad(set_to_none=True)
        model(idx, targets)[0].backward()
        if not hooks:
            allreduce_sequence_parallel_grads(model, dims)
        norm = clip_grad_norm_(model.parameters(), 0.5, dims)
        torch.testing.assert_close(norm, ref_norm, **TOL, msg=f"{tag} grad norm")
        assert ref_norm > 0.5, "the clip must bite for this check to mean anything"
        opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model(idx, targets)[0], ref_copy(idx, targets)[0], **TOL, msg=f"{tag} steps")


def single_device_grads(ref: GPT, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    loss, correct = ref(*batch(dp_rank))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad(set_to_none=True)
    return loss.detach(), correct, grads


def assert_step_matches(model: GPT, dims: ParallelDims, ref_loss: torch.Tensor, ref_grads: dict, label: str) -> None:
    """One forward/backward of the sequence-parallel TP `model` gives the reference loss and full gradients."""
    loss, _ = model(*batch(dims.dp_rank))
    loss.backward()
    allreduce_sequence_parallel_grads(model, dims)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    grads = full_grads(model, dims)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=f"{label} grad {name}")


def check_activation_checkpointing(dims: ParallelDims, ref_loss: torch.Tensor, ref_grads: dict) -> None:
    """Recomputing blocks in backward re-runs their collectives; the gradients must not change."""
    model = build(dims, sequence_parallel=True, overlap=True)
    model.activation_checkpointing = True
    assert_step_matches(model, dims, ref_loss, ref_grads, "checkpointing")


def check_ddp_over_dp_group(dims: ParallelDims, ref: GPT) -> None:
    """The engine's recipe: DDP over the DP group around the TP model averages the replicas' gradients."""
    per_replica = [single_device_grads(ref, r)[2] for r in range(dims.dp_size)]
    ddp = torch.nn.parallel.DistributedDataParallel(build(dims, sequence_parallel=True, overlap=True),
                                                    process_group=dims.dp_group)
    loss, _ = ddp(*batch(dims.dp_rank))
    loss.backward()
    allreduce_sequence_parallel_grads(ddp.module, dims)
    grads = full_grads(ddp.module, dims)
    for name in per_replica[0]:
        mean = sum(g[name] for g in per_replica) / dims.dp_size
        torch.testing.assert_close(grads[name], mean, **TOL, msg=f"DDP grad {name}")


def check_fused_kernels(dims: ParallelDims) -> None:
    """The triton backend's fused matmul+bias+GELU (c_fc) and add+LayerNorm keep working under TP + SP."""
    ops = get_ops("triton")
    ref = build(ops=ops)
    ref_loss, _, ref_grads = single_device_grads(ref, dims.dp_rank)
    assert_step_matches(build(dims, ops=ops, sequence_parallel=True, overlap=True), dims, ref_loss, ref_grads,
                        "triton")


def check_autocast(dims: ParallelDims) -> None:
    """bf16 autocast (the training precision): TP + SP + overlap follows the single-device model."""
    dev = device()
    ref = build()
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        ref_loss, _ = ref(*batch(dims.dp_rank))
    ref_loss.backward()
    model = build(dims, sequence_parallel=True, overlap=True)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss, _ = model(*batch(dims.dp_rank))
    loss.backward()
    allreduce_sequence_parallel_grads(model, dims)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    grads = full_grads(model, dims)
    for name, p in ref.named_parameters():  # bf16 rounding: compare gradients by relative norm
        assert grads[name].dtype == torch.float32
        err = (grads[name] - p.grad).norm() / p.grad.norm()
        assert err < 3e-2, f"autocast grad {name}: relative error {err:.3g}"


def run_model_checks(dims: ParallelDims) -> None:
    ref = build()
    with torch.no_grad():
        ref_logits = ref(batch(dims.dp_rank)[0])
    loss, correct, ref_grads = single_device_grads(ref, dims.dp_rank)
    for sp in (False, True):
        for overlap in (False, True):
            check_mode(dims, ref, ref_grads, ref_logits, (loss, correct), sp, overlap, hooks=False)
    check_mode(dims, ref, ref_grads, ref_logits, (loss, correct), sp=True, overlap=True, hooks=True)
    check_activation_checkpointing(dims, loss, ref_grads)
    check_fused_kernels(dims)
    check_autocast(dims)
    if dims.dp_size > 1:
        check_ddp_over_dp_group(dims, ref)


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4), (4, 2)])
def test_tp_gpt2_matches_single_device(world: int, tp: int):
    spawn(run_model_checks, world, tp)
