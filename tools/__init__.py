"""What users run beside training: the loss-parity gate (parity, parity_matrix, parity_verdict, parity_report), the
run report (report), the training sweep (train_sweep) and the reference trainers (hf_reference, nanogpt_reference).
`python -m tools.<name> --help`; tools/README.md. Studies and GPU drivers are benchmarks/'s; tools never import them.
"""
