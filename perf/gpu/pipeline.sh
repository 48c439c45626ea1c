#!/usr/bin/env bash
# The whole DAG on config/gpu.yaml (the 24-layer toy target, hf backend, GPU training, offline benchmark).
#   EXTRA_CONFIG="file ...": more config files on top; UNTIL="rule ...": stop after those rules (e.g.
#   "extract_hidden_states vocab_map": the shards for `bench.sh training_throughput`); PIPELINE_TIMEOUT (s, 3000).
# Brings back $OUT/results-gpu.tgz (logs, benchmarks, report, benchmark, metrics, manifests) and snakemake.log.
source "$(dirname "$0")/common.sh"
setup
start=$(date +%s)
run_snakemake --rerun-incomplete --configfile config/gpu.yaml ${EXTRA_CONFIG:-} ${UNTIL:+--until $UNTIL} \
  > "$OUT/snakemake.log" 2>&1 || status=$?
tail -n 40 "$OUT/snakemake.log"
wall_seconds "$start"
tar czf "$OUT/results-gpu.tgz" results-gpu/logs results-gpu/benchmarks results-gpu/report results-gpu/benchmark \
  results-gpu/draft/default/metrics.csv results-gpu/draft/default/config.json results-gpu/prepared \
  results-gpu/target/draftsmith_target.json $(ls results-gpu/shards/*/*/manifest.json 2>/dev/null) || true
exit "${status:-0}"
