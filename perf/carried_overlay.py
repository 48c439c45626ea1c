"""Config lines that make each `<dataset>.jsonl` of a folder (regenerate's answers from an earlier run) a local dataset
of the same name, so a run skips self_prompts and regenerate and trains on exactly those answers: recipes compared
across GPU sessions see the same data, and a session spends its device time on training instead of regenerating.

    python perf/carried_overlay.py .carried/results-smollm2-50k/data/regenerated > carried.yaml
    snakemake --configfile config/gpu-smollm2.yaml config/overlays/smollm2-50k.yaml carried.yaml ...

(`perf/gpu_suite.sh smollm2` with CARRIED_DATA=<folder> does this; its runs bring the answers back as
`<results>-data.txz.part_*`.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def carried_datasets(folder: Path) -> dict:
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"{folder}: no <dataset>.jsonl files")
    return {"datasets": {f.stem: {"source": "local", "path": str(f), "regenerate": False} for f in files}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a folder of regenerate's <dataset>.jsonl files")
    args = ap.parse_args(argv)
    yaml.safe_dump(carried_datasets(args.folder), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
