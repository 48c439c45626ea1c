"""The decoders: the benchmark's engine (`engine`, `engine_proposers`: N requests in flight, batch 1 included), its
eager reference (`reference`), regenerate's batched sampler (`batch`), and what they share (cache, graphs, target)."""
