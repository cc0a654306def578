"""The parallel-unaware GPT-2: the model, Hugging Face weights, and the one parameter/FLOP formula."""
