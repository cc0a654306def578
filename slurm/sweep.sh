#!/usr/bin/env bash
# The reference comparison as a job array, one run per task, all in one wandb group:
#   mode  DDP (baseline) | ZeRO-3 (hybrid) | ZeRO-3 + TP2 (hybrid --tp-size 2)
#   x     fused kernels off | on ($FUSED_BACKEND, default cuda)
#   x     two micro-batch sizes ($BATCH_SIZES, default "8 32")
# = 12 tasks, index = ((mode * 2) + fused) * 2 + batch. From the repository root:
#
#   sbatch slurm/sweep.sh --model gpt2-large --max-steps 200          # flags go to every run
#   sbatch --array=0-3 slurm/sweep.sh --model gpt2-large              # DDP only
#
# Each task is one single-node run of slurm/common.sh (job folder runs/<job name>-<array id>_<task id>/,
# preemption-safe like the other scripts); WANDB_GROUP defaults to sweep-<array id>. Compare the runs with
# their summary.json files or in wandb, grouped.
#SBATCH --job-name=gpt2-sweep
#SBATCH --array=0-11
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=01:00:00
#SBATCH --partition=gpu
##SBATCH --account=YOUR_ACCOUNT
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out

source "${GPT2_REPO:-$SLURM_SUBMIT_DIR}/slurm/common.sh"

read -r -a batches <<<"${BATCH_SIZES:-8 32}"
modes=("--mode baseline" "--mode hybrid" "--mode hybrid --tp-size 2")
fused=("--fused-kernels none" "--fused-kernels ${FUSED_BACKEND:-cuda}")
task="${SLURM_ARRAY_TASK_ID:?sweep.sh runs as a job array (sbatch --array)}"
n_tasks=$((${#modes[@]} * ${#fused[@]} * ${#batches[@]}))
if [ "$task" -ge "$n_tasks" ]; then
  echo "sweep.sh: array task $task, but the sweep has $n_tasks runs (0-$((n_tasks - 1)))" >&2
  exit 2
fi
b=$((task % ${#batches[@]}))
f=$((task / ${#batches[@]} % ${#fused[@]}))
m=$((task / ${#batches[@]} / ${#fused[@]}))
export WANDB_GROUP="${WANDB_GROUP:-sweep-$SLURM_ARRAY_JOB_ID}"
# unquoted on purpose: each mode / fused entry splits into its flags
run_flags=(${modes[$m]} ${fused[$f]} --batch-size "${batches[$b]}")
# the sweep's own flags come last, so they win over the same flags given on the sbatch line
gpt2_main "$@" "${run_flags[@]}" --wandb-tags sweep
