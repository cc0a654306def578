"""What a run is asked to do: the config schema and parser, and RunLayout (every fact derived from the config
and the launch).
"""
