"""What a run reports: meters (throughput, MFU, memory), run logging (JSONL, wandb, console), profiling."""
