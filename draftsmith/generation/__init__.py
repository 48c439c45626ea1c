"""Generation: the target writes training data (regenerate: its answers to a dataset's prompts; self_prompts: the
prompts themselves), one driver and its backends (hf, vllm), as extraction is."""
