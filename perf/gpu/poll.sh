#!/usr/bin/env bash
# Wait up to POLL_SECONDS (540) for the launched run, then bring back its $OUT, or while it runs, what it has so far.
# (A call brings back at most 8 files: the run's own, or partial.tgz of its logs, benchmarks, stats and metrics,
# from which `python -m perf partial_report` builds the report of the variants that finished.)
source "$(dirname "$0")/common.sh"
end=$(( SECONDS + ${POLL_SECONDS:-540} ))
while [ $SECONDS -lt $end ] && [ ! -f /tmp/suite-out/done ]; do sleep 5; done
if [ -f /tmp/suite-out/done ]; then echo "finished, exit $(cat /tmp/suite-out/done)"; else echo "still running"; fi
log=/tmp/suite-out/snakemake.log
[ ! -f "$log" ] || grep -E "Finished jobid|^localrule|^rule |Error" "$log" | tail -n 12
(cd /tmp/suite-out && for f in *; do [ "$f" = done ] || cp -r "$f" "$OUT/"; done) 2>/dev/null || true
[ -f /tmp/suite-out/done ] || (cd "$RUN_DIR" && tar czf "$OUT/partial.tgz" $(ls -d results-*/logs results-*/benchmarks \
  results-*/data/*/*.stats.json results-*/draft/*/metrics.csv results-*/draft/*/training_data.json \
  results-*/draft/*/config.json results-*/shards/*/*/manifest.json results-*/benchmark/*/summary.json \
  results-*/benchmark/*/per_prompt.csv results-*/report results-*/prepared/*/stats.json 2>/dev/null)) || true
