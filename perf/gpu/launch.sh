#!/usr/bin/env bash
# Start a run detached, so that it outlives the call: MODE=smollm2 (default) or pipeline, its $OUT /tmp/suite-out.
# The run's own variables (EXTRA_CONFIG, TARGETS, FP32_CHECK, ...) are passed through; poll.sh waits for it.
# It runs in its own copy of the tree, RUN_DIR: every later call sends the working tree again, replacing its files
# while the run reads them (on 2026-12-07 a job that imported draftsmith.fingerprints during a poll's copy failed with
# ModuleNotFoundError). Results and Snakemake's records stay in RUN_DIR, so a relaunch on the same machine resumes.
source "$(dirname "$0")/common.sh"
# carried answers (ANSWERS_IN) are read where they were carried, not copied: absolute paths into this checkout
[ -z "${ANSWERS_IN:-}" ] || export ANSWERS_IN="$(for d in $ANSWERS_IN; do realpath "$d"; done | xargs)"
mkdir -p /tmp/suite-out "$RUN_DIR"
rm -f /tmp/suite-out/done
tar cf - --exclude='./results-*' --exclude=./.snakemake --exclude=./.git --exclude=./.whl --exclude='./.gpu_parts*' \
  --exclude='./.gpu_answers*' --exclude='./.venv*' . | tar xf - -C "$RUN_DIR"
cd "$RUN_DIR"
setsid nohup bash -c "OUT=/tmp/suite-out bash perf/gpu/${MODE:-smollm2}.sh > /tmp/suite-out/suite.log 2>&1; \
  echo \$? > /tmp/suite-out/done" > /dev/null 2>&1 < /dev/null &
echo "launched ${MODE:-smollm2} in $RUN_DIR (pid $!); perf/gpu/poll.sh waits for it"
