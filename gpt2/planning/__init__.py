"""Predicted memory, communication and step time for a layout (perf_model, planner); train.py and the plan CLI use it,
the loop never imports it.
"""
