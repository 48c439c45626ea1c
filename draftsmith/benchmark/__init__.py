"""Benchmarks: the offline speculative-decoding loop and the vLLM server backend, and their shared result tables."""
