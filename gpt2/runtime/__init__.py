"""Process set-up and the model build order: distributed init, parallelize (TP -> activation checkpointing -> ZeRO
leaves -> compile), compile settings.
"""
