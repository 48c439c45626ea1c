"""Chat data: reading datasets, normalising records, tokenizing with loss masks, the synthetic corpus, benchmark prompts."""
