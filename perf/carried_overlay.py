"""Config lines that make each `<dataset>.jsonl` of a folder (regenerate's answers from an earlier run) a local dataset
of the same name, so a run skips self_prompts and regenerate and trains on exactly those answers: recipes compared
across GPU sessions see the same data, and a session spends its device time on training instead of regenerating.

    python perf/carried_overlay.py results-smollm2-50k/data/regenerated > carried.yaml
    python perf/carried_overlay.py perf/carried/results-smollm2-50k-data.txz --unpack-to /tmp/carried > carried.yaml
    snakemake --configfile config/gpu-smollm2.yaml config/overlays/smollm2-50k.yaml carried.yaml ...

(`perf/gpu_suite.sh smollm2` with CARRIED_DATA=<folder or archive> does this; its runs bring the answers back as
`<results>-data.txz.part_*`, which a later call can carry as they are: 8 MB for the 50k scale's 53 MB of answers,
tracked in perf/carried/.)
"""

from __future__ import annotations

import argparse
import lzma
import sys
import tarfile
from pathlib import Path

import yaml


def carried_datasets(folder: Path) -> dict:
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"{folder}: no <dataset>.jsonl files")
    return {"datasets": {f.stem: {"source": "local", "path": str(f), "regenerate": False} for f in files}}


def unpacked_answers(archive: Path, into: Path) -> Path:
    """The regenerated/ folder of `<archive>.part_*` (a run's answers: xz-compressed tar in parts, joined in order)
    unpacked into `into`."""
    parts = sorted(archive.parent.glob(archive.name + ".part_*"))
    if not parts:
        raise SystemExit(f"{archive}: no {archive.name}.part_* files beside it")
    joined = into / (archive.name + ".joined")
    into.mkdir(parents=True, exist_ok=True)
    with open(joined, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    with lzma.open(joined) as xz, tarfile.open(fileobj=xz) as tar:
        tar.extractall(into, filter="data")
    joined.unlink()
    folders = sorted(into.glob("*/data/regenerated"))
    if len(folders) != 1:
        raise SystemExit(f"{archive}: expected one <results>/data/regenerated folder inside, found {len(folders)}")
    return folders[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("answers", type=Path, help="a folder of regenerate's <dataset>.jsonl files, or the prefix of a "
                                                "run's <results>-data.txz.part_* files (with --unpack-to)")
    ap.add_argument("--unpack-to", type=Path, help="where to unpack an archive's parts")
    args = ap.parse_args(argv)
    folder = args.answers
    if not folder.is_dir():
        if args.unpack_to is None:
            raise SystemExit(f"{folder}: not a folder; an archive's parts need --unpack-to")
        folder = unpacked_answers(folder, args.unpack_to)
    yaml.safe_dump(carried_datasets(folder), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
