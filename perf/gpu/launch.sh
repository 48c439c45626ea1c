#!/usr/bin/env bash
# Start a run detached, so that it outlives the call: MODE=smollm2 (default) or pipeline, its $OUT /tmp/suite-out.
# The run's own variables (EXTRA_CONFIG, TARGETS, FP32_CHECK, ...) are passed through; poll.sh waits for it.
source "$(dirname "$0")/common.sh"
mkdir -p /tmp/suite-out
rm -f /tmp/suite-out/done
setsid nohup bash -c "OUT=/tmp/suite-out bash perf/gpu/${MODE:-smollm2}.sh > /tmp/suite-out/suite.log 2>&1; \
  echo \$? > /tmp/suite-out/done" > /dev/null 2>&1 < /dev/null &
echo "launched ${MODE:-smollm2} (pid $!); perf/gpu/poll.sh waits for it"
