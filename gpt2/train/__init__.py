"""The loop over steps and what it writes: the loop with its records and summary, checkpoints (through the engines'
state methods), preemption, export.
"""
