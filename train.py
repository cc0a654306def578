"""Train GPT-2: one entry point for every mode (the checkout's shim over gpt2.train.main, installed as `gpt2-train`).

    python train.py --mode single --model gpt2-tiny --data synthetic          # one device (CPU works)
    torchrun --nproc_per_node=4 train.py --mode baseline --model gpt2-large   # DDP
    deepspeed --num_gpus=4 train.py --mode hybrid --tp-size 2                 # ZeRO-3 (+ TP)
    python train.py --plan --mode hybrid --model gpt2-large --gpus 4 [--search]  # predicted memory/communication

Exit statuses and the start-up order: gpt2/train/main.py. `import train` gives its `main` (tools.simulate_rank and the
tests call train.main(argv) in-process); gpt2.train.main imports no torch, so `cli` still installs the preemption
watcher before torch loads.
"""

from gpt2.train.main import check_before_work, cli, main, resume_command

__all__ = ["check_before_work", "cli", "main", "resume_command"]

if __name__ == "__main__":
    cli()
