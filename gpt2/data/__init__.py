"""Text to DP-sharded token batches: the tokenizer, the on-disk token cache and the loader
(`python -m gpt2.data` pre-builds the cache).
"""
