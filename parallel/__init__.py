"""Our tensor parallelism (Megatron-style TP + sequence parallelism) for gpt2.model.gpt.GPT.

    dims.py    ParallelDims: the arange(world).view(dp, tp) grid and its TP / DP groups
    comm.py    autograd collectives (f, g, gather, scatter, sequence all-gather / reduce-scatter), CommStats
    layers.py  ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead, ...
    loss.py    vocab-parallel cross-entropy (+ top-1 count), never gathering the logits
    tp_plan.py PLAN (module -> parallel style, as data), apply_tensor_parallel, state-dict shard / gather
    grads.py   sequence-parallel gradient all-reduce, TP-aware gradient clipping
    mpu.py     ModelParallelUnit: the `mpu` DeepSpeed expects, over a ParallelDims

How an engine uses it, in this order (torchtitan's: TP -> activation checkpointing -> compile -> DP):

    dims = ParallelDims(world_size, rank, tp_size); dims.build_groups()   # every rank
    # sizes checked beforehand, with the fix: gpt2.config.layout.RunLayout.resolve(cfg, world_size, device)
    torch.manual_seed(seed); model = GPT(cfg.model, ops, attention)        # full model, same on every rank;
    n_params = model.num_params()                                          #   not under deepspeed.zero.Init
    apply_tensor_parallel(model, dims, sequence_parallel=sp, overlap=tp_overlap)  # shards it in place
    model.activation_checkpointing = ac
    model = torch.compile(model) if compile else model
    # DDP:        DDP(model, device_ids=[local_rank], process_group=dims.dp_group)
    #             after the step's last backward: parallel.grads.allreduce_sequence_parallel_grads(model, dims)
    #             clip with parallel.grads.clip_grad_norm_(model.parameters(), max_norm, dims)
    # DeepSpeed:  parallel.grads.register_sequence_parallel_grad_hooks(model, dims)   # before initialize
    #             deepspeed.initialize(model=model, mpu=ModelParallelUnit(dims), ...) # ZeRO over dp_group;
    #             its clipping reads the `tensor_model_parallel` marks the plan sets

What the engine must keep in mind:
- Data: the ranks of one TP group consume the same batch; shard the data by dims.dp_rank / dims.dp_size,
  and count tokens per step with dp_size, not world_size.
- Loss and n_correct come back identical on every TP rank; logits (targets=None, eval/generation) are
  gathered to [B, T, vocab_size] on every rank.
- `model.num_params()` after TP counts only this rank's shards: take FLOPs/MFU counts from the full model.
- Checkpoints: `gather_state_dict(model, dims)` (collective over the TP group) gives the single-device
  state dict for export; `shard_state_dict(full, dims.tp_rank, dims.tp_size)` loads one into a TP
  model (or load it into the full model before apply_tensor_parallel, e.g. --init-from).
- Overlap: set CUDA_DEVICE_MAX_CONNECTIONS=1 so each async input-gradient collective is queued before
  the weight-gradient GEMM it overlaps. The fused LM-head cross-entropy of `ops` is not used under TP
  (the loss is vocab-parallel); `ops.linear` and `ops.add_layernorm` are.
- Dropout: every rank draws from the same RNG stream, so with dropout > 0 the masks inside TP regions
  (per-rank heads) and SP regions (per-rank sequence shards) are valid but correlated across ranks and
  differ from the single-device masks. The presets use dropout 0.
"""
