"""The decoding engine of the benchmark and of regenerate (`engine`, `batch_target`, `engine_proposers`: N requests in
flight, batch 1 included), its eager reference (`reference`), and what they share (cache, graphs, sampler, target)."""
