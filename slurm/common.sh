# Shared body of the sbatch scripts (sourced by them, not run): job folder, pre-flight, srun + launcher,
# preemption and requeue. Submit from the repository root (Slurm runs a copy of the script from its spool
# folder, so the repository is found through $SLURM_SUBMIT_DIR, or $GPT2_REPO when set).
#
# Knobs (environment variables; sbatch passes the submitting shell's environment on):
#   LAUNCHER        torchrun (default) | deepspeed: the per-node launcher that srun starts
#   NPROC_PER_NODE  processes per node, one per GPU (default: $SLURM_GPUS_ON_NODE, else 1)
#   OUT_DIR         parent of job folders (default: runs)
#   RUN_NAME        job folder name (default: <job name>-<job id>; array tasks: <name>-<array id>_<task id>)
#   WANDB_GROUP     wandb group of every attempt of this job (default: $RUN_NAME; sweep.sh: the whole array)
#   PYTHON          interpreter with the harness installed (default: as scripts/python_env.sh chooses: an
#                   active venv/conda env, else the repository's .venv); torchrun/deepspeed come from it
#
# Job folder $OUT_DIR/$RUN_NAME/:
#   batch.log             this script's messages (also in Slurm's --output file)
#   checkpoints/          --save-dir of every attempt; each attempt passes --resume auto
#   attempt-N/            train.py's run folder of the N-th start ($SLURM_RESTART_COUNT): metrics.jsonl,
#                         summary.json, config.json, console.log
#   attempt-N.task-T.log  stdout/stderr of srun task T (one launcher per node, with all its ranks' output)
#
# Preemption, the signal chain (tested end to end by tests/integration/test_slurm.py):
#   1. `#SBATCH --signal=B:USR1@120` makes Slurm send SIGUSR1 to this batch shell only, 120 s before the
#      time limit (by hand: `scancel --signal=USR1 --batch JOBID`).
#   2. The trap below runs `scancel --signal=USR1 $SLURM_JOB_ID`: without --batch/--full that signals every
#      process of the job's steps on every node (the launchers and all their workers), not this shell.
#   3. torchrun and the deepspeed launcher would die of SIGUSR1 (its default action; torchrun handles only
#      SIGTERM/SIGINT/SIGHUP/SIGQUIT unless told otherwise), so slurm/task.sh starts them with SIGUSR1
#      ignored; their workers inherit that and train.py installs its own handler (gpt2/train/preemption.py) once
#      its process group is up (a SIGUSR1 before that, during start-up, is lost; SIGTERM still ends the job).
#   4. Each worker's handler sets a flag; at the next step boundary all ranks all-reduce it (MAX), save the
#      same step to checkpoints/ and exit 75 (EXIT_PREEMPTED). The launchers see failed workers and exit
#      non-zero (torchrun flattens the code to 1), so srun ends non-zero.
#   5. This shell, having seen SIGUSR1 and a non-zero step, runs `scontrol requeue $SLURM_JOB_ID` (needs
#      `#SBATCH --requeue`). The job starts again with SLURM_RESTART_COUNT+1, and --resume auto continues
#      from checkpoints/latest. A step that ended 0 (training finished just in time) is not requeued.
#   SIGTERM (scancel, preemption by a higher-priority job, the time limit itself) reaches every step
#   process from Slurm directly: workers save and exit 75 the same way within KillWait, launchers forward
#   it to the workers too (torchrun waits $TORCH_ELASTIC_SHUTDOWN_TIMEOUT s, default set here, then
#   SIGKILLs them). This shell only logs it: requeue after preemption is Slurm's (PreemptMode=REQUEUE).
#
# NCCL (set before submitting to change; the launchers pass the environment to every rank):
#   NCCL_NVLS_ENABLE=0    exported by default: NVLink SHARP (multicast) collectives need fabric-manager
#                         multicast support that many nodes lack (communicator set-up then fails or hangs),
#                         and they gain little at this model size. Set NCCL_NVLS_ENABLE=1 where it works.
#   NCCL_DEBUG=WARN       INFO prints the chosen transports/rings once per rank (first thing to check when
#                         multi-node is slow: NET/IB expected between nodes, P2P/NVLS or NVLink within).
#   NCCL_SOCKET_IFNAME    interface for bootstrap and socket transport (e.g. ib0, ^lo,docker) when the
#                         default pick is wrong; NCCL_IB_HCA picks InfiniBand adapters (e.g. mlx5).
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (PyTorch's default): a failed or timed-out collective aborts the
#                         process instead of hanging the job until its time limit.

set -euo pipefail

# shellcheck source=scripts/python_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/python_env.sh"
gpt2_python_env
: "${LAUNCHER:=torchrun}"
: "${NPROC_PER_NODE:=${SLURM_GPUS_ON_NODE:-1}}"
: "${OUT_DIR:=runs}"
: "${NCCL_NVLS_ENABLE:=0}"
: "${NCCL_DEBUG:=WARN}"
: "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:=100}"  # SIGTERM -> SIGKILL grace for torchrun's workers: a checkpoint
export LAUNCHER NPROC_PER_NODE PYTHON NCCL_NVLS_ENABLE NCCL_DEBUG TORCH_ELASTIC_SHUTDOWN_TIMEOUT

gpt2_log() {
  local line
  line="$(date '+%F %T') [slurm ${SLURM_JOB_ID:-?}] $*"
  echo "$line"
  if [ -n "${JOB_DIR:-}" ]; then echo "$line" >>"$JOB_DIR/batch.log"; fi
}

gpt2_on_usr1() {
  PREEMPTED=1
  gpt2_log "SIGUSR1: asking every rank to checkpoint and exit (scancel --signal=USR1 $SLURM_JOB_ID)"
  scancel --signal=USR1 "$SLURM_JOB_ID" || gpt2_log "scancel --signal=USR1 failed"
}

gpt2_on_term() {
  gpt2_log "SIGTERM: Slurm is ending the job; workers checkpoint on their own if they can"
}

# gpt2_main [train.py flags...]: everything after the script name on the sbatch line ends up here.
gpt2_main() {
  cd "${GPT2_REPO:-$SLURM_SUBMIT_DIR}"
  if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
    : "${RUN_NAME:=${SLURM_JOB_NAME}-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"
  else
    : "${RUN_NAME:=${SLURM_JOB_NAME}-${SLURM_JOB_ID}}"
  fi
  JOB_DIR="$OUT_DIR/$RUN_NAME"
  local attempt="${SLURM_RESTART_COUNT:-0}"
  mkdir -p "$JOB_DIR"

  # rendezvous from Slurm's own variables: the first node of the allocation hosts the c10d store, at the
  # address Slurm itself reaches it by (NodeAddr), on a port derived from the job id (distinct for concurrent
  # jobs, the same after a requeue)
  local head_node
  head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  HEAD="$(scontrol show node -o "$head_node" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' || true)"
  HEAD="${HEAD:-$head_node}"
  PORT=$((20000 + SLURM_JOB_ID % 20000))
  AGENTS="${SLURM_NTASKS:-$SLURM_NNODES}"  # one launcher per task; the scripts ask for one task per node
  HOSTFILE="$JOB_DIR/hostfile.$attempt"   # the deepspeed launcher's view of the allocation
  scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/ slots=$NPROC_PER_NODE/" >"$HOSTFILE"
  export HEAD PORT AGENTS HOSTFILE

  local train_args=(--out-dir "$JOB_DIR" --run-name "attempt-$attempt" --save-dir "$JOB_DIR/checkpoints"
                    --resume auto --wandb-group "${WANDB_GROUP:-$RUN_NAME}" "$@")
  gpt2_log "attempt $attempt on $SLURM_JOB_NODELIST: $AGENTS x $LAUNCHER x $NPROC_PER_NODE processes," \
           "rendezvous $HEAD:$PORT, job folder $JOB_DIR"
  "$PYTHON" slurm/preflight.py --nodes "$AGENTS" --nproc-per-node "$NPROC_PER_NODE" -- "${train_args[@]}" \
    2>&1 | tee -a "$JOB_DIR/batch.log"

  PREEMPTED=0
  trap gpt2_on_usr1 USR1
  trap gpt2_on_term TERM
  # --kill-on-bad-exit=0: after a preemption save every launcher exits non-zero; let each finish its own
  # shutdown (rank 0 closes the metrics and wandb) instead of srun killing the slower ones
  srun --ntasks="$AGENTS" --kill-on-bad-exit=0 --output="$JOB_DIR/attempt-$attempt.task-%t.log" \
    slurm/task.sh "${train_args[@]}" &
  local step_pid=$! rc
  while :; do  # a trapped signal interrupts `wait` (status > 128) while srun still runs: wait again
    rc=0
    wait "$step_pid" || rc=$?
    if [ "$rc" -gt 128 ] && kill -0 "$step_pid" 2>/dev/null; then continue; fi
    break
  done
  gpt2_log "srun ended with status $rc"
  if [ "$PREEMPTED" = 1 ] && [ "$rc" != 0 ]; then
    gpt2_log "preempted: requeueing; the next attempt resumes from $JOB_DIR/checkpoints"
    if scontrol requeue "$SLURM_JOB_ID"; then exit 0; fi
    gpt2_log "scontrol requeue refused (submitted with --no-requeue?): resubmit; --resume auto continues"
  fi
  exit "$rc"
}
