"""Decoding over a static KV cache, shared by the benchmark (batch-1 and batched speculative loops) and regenerate (batched
answers with continuous refill): fixed-address state that CUDA graphs can replay, and the same code eager on a CPU."""
