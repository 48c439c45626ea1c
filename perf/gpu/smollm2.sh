#!/usr/bin/env bash
# The SmolLM2-135M-Instruct run on config/gpu-smollm2.yaml: every variant trained and benchmarked on MT-Bench.
#   PER_CATEGORY=n (10: all 80 questions); MAX_NEW_TOKENS=n; UNTIL=rule; PIPELINE_TIMEOUT (s, 3000);
#   EXTRA_CONFIG="file ...": more config files (e.g. config/overlays/smollm2-50k.yaml config/overlays/smollm2-50k-longer.yaml);
#   TARGETS="file ...": build only those (e.g. the first variant's summary.json, so FP32_CHECK follows it at once);
#   FP32_CHECK=1: then the first variant's benchmark again in float32 (losslessness; under load each prompt once), in
#   $OUT/$res-fp32.tgz;
#   THEN_TARGETS="file ...": then these in the run's own config (bf16), in $OUT/$res-then.tgz; THEN_CONFIG="file ...":
#   more config files for that step alone (e.g. config/overlays/batch-1.yaml: the learning curve's variants at batch 1);
#   TRAINING_PERF=1: then `python -m perf training_throughput` on the run's shards;
#   GPU_TESTS=1: first the GPU-only engine tests (common.sh gpu_tests), stopping the run where they fail;
#   ONLINE_PERF=1: then (before THEN_TARGETS) `python -m perf online_training` on the run (online vs offline hidden
#   states, loaded ahead or serially, training.compile attention vs forward; ONLINE_PERF_RUNS picks the runs, the
#   shards are extracted first only where one is offline; ONLINE_PERF_FRACTION trains on that fraction), in $OUT.
#   ANSWERS_OUT=1: at the end (UNTIL=regenerate too), the regenerated answers packed into $OUT
#   (`python -m perf carried_answers pack`: answers.tar.xz.part_* of ANSWERS_PART_MIB MiB (15) and answers.sha256,
#   in the room the run's own files leave of $OUT's 8; ANSWERS_DATASETS="a,b": only those);
#   ANSWERS_IN="dir ...": before the run, the carried folders of such parts (e.g. ".gpu_answers1 .gpu_answers2")
#   unpacked into /tmp/answers, their datasets (source local) in /tmp/answers.yaml, the last config file.
# The workflow's own priorities order the jobs (the target-written data first, the first variant benchmarked first).
source "$(dirname "$0")/common.sh"
setup
install_smollm2
[ -z "${GPU_TESTS:-}" ] || gpu_tests
overlay=/tmp/smollm2-overlay.yaml
printf 'benchmark:\n  mt_bench:\n    per_category: %s\n' "${PER_CATEGORY:-10}" > "$overlay"
[ -z "${MAX_NEW_TOKENS:-}" ] || printf '  max_new_tokens: %s\n' "$MAX_NEW_TOKENS" >> "$overlay"
configs="config/gpu-smollm2.yaml $overlay ${EXTRA_CONFIG:-}"
if [ -n "${ANSWERS_IN:-}" ]; then  # another session's answers: the overlay lists datasets, so it goes last
  python3 -m perf carried_answers unpack $ANSWERS_IN --into /tmp/answers --overlay /tmp/answers.yaml --configs $configs
  configs="$configs /tmp/answers.yaml"
fi
res=$(grep -h '^results:' config/gpu-smollm2.yaml ${EXTRA_CONFIG:-} | tail -n 1 | awk '{print $2}')  # the last that names one
start=$(date +%s)
run_snakemake ${TARGETS:-} --rerun-incomplete --configfile $configs ${UNTIL:+--until "$UNTIL"} \
  > "$OUT/snakemake.log" 2>&1 || status=$?
tail -n 40 "$OUT/snakemake.log"
wall_seconds "$start"
tar czf "$OUT/$res.tgz" $res/logs $res/benchmarks $res/report $res/benchmark $res/draft/*/metrics.csv \
  $res/draft/*/config.json $res/draft/*/training_data.json $res/prepared/*/stats.json \
  $(ls $res/data/*/*.stats.json 2>/dev/null) $res/target/draftsmith_provenance.json \
  $(ls $res/shards/*/*/manifest.json 2>/dev/null) || true
if [ -n "${FP32_CHECK:-}" ] && [ -z "${status:-}" ]; then  # after $res.tgz took the bf16 results, which this replaces
  first=$(python3 -c "import sys; from draftsmith.config.workflow import load_config as c; print(next(iter(c(sys.argv[1:])['variants'])))" $configs)
  # losslessness, not speed: no prompt lookup (the hybrid has its drafts), and under load every prompt once (one
  # pass: 80 requests at 64 in flight instead of the timing's 560; each concurrency still meets every prompt)
  printf 'benchmark:\n  dtype: float32\n  methods: [target_greedy, eagle3_draft, hybrid]\n  load_requests_per_row: 1\n' \
    > /tmp/fp32-overlay.yaml
  run_snakemake "$res/benchmark/$first/summary.json" --configfile $configs /tmp/fp32-overlay.yaml \
    > /tmp/snakemake-fp32.log 2>&1 || status=$?
  tail -n 5 /tmp/snakemake-fp32.log
  tar czf "$OUT/$res-fp32.tgz" "$res/benchmark/$first" "$res/logs/benchmark/$first.log" /tmp/snakemake-fp32.log || true
fi
if [ -n "${ONLINE_PERF:-}" ] && [ -z "${status:-}" ]; then
  runs=${ONLINE_PERF_RUNS:-online:attention,offline:attention,offline:forward}
  if [[ "$runs" == *offline* ]]; then
    printf 'training:\n  hidden_states: offline\n' > /tmp/offline-overlay.yaml
    run_snakemake --configfile $configs /tmp/offline-overlay.yaml --until extract_hidden_states vocab_map \
      > /tmp/snakemake-shards.log 2>&1 || status=$?
    tail -n 3 /tmp/snakemake-shards.log
  fi
  python3 -m perf online_training --results "$res" --table "$OUT/online_training.md" --runs "$runs" \
    --data-fraction "${ONLINE_PERF_FRACTION:-1}" 2>&1 | tail -n 12
fi
if [ -n "${THEN_TARGETS:-}" ] && [ -z "${status:-}" ]; then
  run_snakemake $THEN_TARGETS --configfile $configs ${THEN_CONFIG:-} > /tmp/snakemake-then.log 2>&1 || status=$?
  tail -n 5 /tmp/snakemake-then.log
  tar czf "$OUT/$res-then.tgz" $(for t in $THEN_TARGETS; do dirname "$t"; done) $res/benchmarks $res/draft/*/metrics.csv \
    $res/draft/*/training_data.json $res/draft/*/config.json $res/logs/benchmark $res/logs/train_draft \
    /tmp/snakemake-then.log || true
fi
if [ -n "${TRAINING_PERF:-}" ] && [ -z "${status:-}" ]; then
  python3 -m perf training_throughput --results "$res" --min-steps 100 --total-seq-length 8192 \
    --table "$OUT/training.md" 2>&1 | tail -n 12
fi
if [ -n "${ANSWERS_OUT:-}" ]; then  # whatever the run's status: the datasets regenerate finished are packed, last,
  # into the room the other files leave of the 8 that $OUT brings back (an earlier pack's parts are replaced)
  room=$(( 8 - $(find "$OUT" -maxdepth 1 -type f ! -name done ! -name 'answers.*' | wc -l) ))
  python3 -m perf carried_answers pack "$res" --out "$OUT" --part-mib "${ANSWERS_PART_MIB:-15}" --max-files "$room" \
    ${ANSWERS_DATASETS:+--datasets "$ANSWERS_DATASETS"} || status=${status:-$?}
fi
exit "${status:-0}"
