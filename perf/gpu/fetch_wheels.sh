#!/usr/bin/env bash
# On the CPU machine: download perf/gpu/wheels.txt for the GPU machine (CPython 3.12, x86_64) into .whl/.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -v '^#' perf/gpu/wheels.txt | grep -v '^$' | while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
    -d .whl "$req" 2>/dev/null >/dev/null \
  || python3 -m pip wheel -q --no-deps -w .whl "$req" 2>&1 | grep -v "^WARNING: Location" || true  # sdist-only, pure Python
done
du -sh .whl
