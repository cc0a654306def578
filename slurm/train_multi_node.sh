#!/usr/bin/env bash
# GPT-2 on several nodes: srun starts one launcher per node (torchrun with c10d rendezvous on the first node,
# or LAUNCHER=deepspeed without ssh), each starting one process per GPU of its node.
# Edit the #SBATCH lines for your cluster (or override them on the sbatch line), then, from the repo root:
#
#   sbatch slurm/train_multi_node.sh --mode hybrid --tp-size 2 --model gpt2-xl --batch-size 16
#   LAUNCHER=deepspeed sbatch slurm/train_multi_node.sh --mode hybrid --model gpt2-large
#
# Everything after the script name goes to train.py. The job folder is runs/<job name>-<job id>/ (slurm/common.sh
# describes it, the knobs, the NCCL settings and the preemption chain). Preemption-safe: 120 s before the time
# limit every rank checkpoints, the job requeues itself and resumes from the checkpoint.
#SBATCH --job-name=gpt2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=04:00:00
#SBATCH --partition=gpu
##SBATCH --account=YOUR_ACCOUNT
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

source "${GPT2_REPO:-$SLURM_SUBMIT_DIR}/slurm/common.sh"
gpt2_main "$@"
