#!/usr/bin/env bash
# One srun task = one node's launcher, which starts that node's $NPROC_PER_NODE training processes.
# Run by slurm/common.sh (it exports LAUNCHER, NPROC_PER_NODE, PYTHON, HEAD, PORT, AGENTS, HOSTFILE);
# the arguments are train.py's flags.
set -euo pipefail
# SIGUSR1 (preemption, see common.sh) must reach the workers without killing their launcher, whose default
# action for it is to die: ignored here, inherited as ignored by the launcher and its workers, and replaced
# by train.py's own handler in each worker.
trap '' USR1
case "$LAUNCHER" in
  torchrun)
    # c10d rendezvous: ranks are given out by the store on $HEAD:$PORT, so no node rank is needed
    exec "$PYTHON" -m torch.distributed.run --nnodes="$AGENTS" --nproc-per-node="$NPROC_PER_NODE" \
      --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 \
      train.py "$@" ;;
  deepspeed)
    # no ssh: every node runs its own launcher; its node rank is this task's rank (one task per node)
    exec deepspeed --hostfile="$HOSTFILE" --no_ssh --node_rank="$SLURM_PROCID" --master_addr="$HEAD" \
      --master_port="$PORT" train.py "$@" ;;
  *)
    echo "slurm/task.sh: LAUNCHER must be torchrun or deepspeed, got '$LAUNCHER'" >&2
    exit 2 ;;
esac
