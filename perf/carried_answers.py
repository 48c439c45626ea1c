"""Carry a run's regenerated answers from the machine where the target wrote them to one where the draft trains.

pack: RESULTS/data/regenerated/<name>.jsonl and the <name>.stats.json beside each (what rule regenerate wrote) as
one answers.tar.xz, cut into answers.tar.xz.part_00, _01, ... of at most --part-mib MiB, and answers.sha256
(sha256sum's format: each part, and the whole stream as answers.tar.xz). At most --max-files files in all (8: what a
lent GPU machine's $OUT brings back); more is refused before anything is written under the final names.

unpack: the parts from one or more folders (a carry of 64 MiB may not hold them all; packs of several sessions, each
with its answers.sha256, may come together), each part and each whole stream checked against answers.sha256, the
files extracted into --into, and a config overlay listing each dataset as `{source: local, path: <its jsonl>}`.
prepare_dataset then reads those answers as it reads regenerate's, and its stats carry regenerate's
(read_regenerate_stats: the .stats.json beside the file, while its sha256 matches). The overlay lists `datasets`, so
it replaces the datasets map of the config files before it: give it last. With --configs (those files), the overlay
keeps their other datasets and each carried one's keep_cut_answers.

    python -m perf carried_answers pack results-gpu --out $OUT [--part-mib 15] [--datasets a,b]
    python -m perf carried_answers unpack .gpu_answers1 .gpu_answers2 --into /tmp/answers --overlay /tmp/answers.yaml
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator

from draftsmith.config.workflow import SCHEMA, merge_files
from draftsmith.data.regenerated import read_regenerate_stats, regenerate_stats_path
from draftsmith.io import sha256_file, write_text
from perf.common import parser

STREAM = "answers.tar.xz"
PART = STREAM + ".part_"
SUMS = "answers.sha256"
MAX_FILES = 8  # a lent machine's $OUT brings back at most 8 files, 16 MiB each
MAX_PART_MIB = 16
MIB = 1 << 20
MEMBER = re.compile(r"([A-Za-z0-9_-]+)(\.jsonl|\.stats\.json)")  # <name> as the config schema's propertyNames


class Refused(Exception):
    pass


def mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"


def regenerated_datasets(results: Path, wanted: list[str] | None) -> dict[str, tuple[Path, Path]]:
    """name -> (its answers, its stats) under results/data/regenerated, each checked: its stats describe it. A
    dataset regenerate did not finish is refused when named, else left out (a run cut short carries the others)."""
    folder = results / "data" / "regenerated"
    found = {p.name.removesuffix(".jsonl"): p for p in sorted(folder.glob("*.jsonl")) if MEMBER.fullmatch(p.name)}
    missing = [name for name in wanted or [] if name not in found]
    if not found or missing:
        raise Refused(f"{folder}: no answers for {', '.join(missing) or 'any dataset'} (there are: "
                      f"{', '.join(found) or 'none; rule regenerate writes <name>.jsonl'})")
    datasets = {}
    for name in wanted or found:
        jsonl, stats = found[name], regenerate_stats_path(found[name])
        if not stats.is_file():
            problem = f"{jsonl}: no {stats.name} beside it (rule regenerate writes both; did it finish?)"
        elif read_regenerate_stats(jsonl) is None:
            problem = (f"{stats} does not describe {jsonl} (its output_sha256 differs: a file changed after "
                       "regenerate wrote it, or it did not finish)")
        else:
            datasets[name] = (jsonl, stats)
            continue
        if wanted:
            raise Refused(problem)
        print(f"note: {problem}: left out")
    if not datasets:
        raise Refused(f"{folder}: no finished dataset (each needs its <name>.stats.json, matching)")
    return datasets


def pack(results: Path, out: Path, part_bytes: int, wanted: list[str] | None = None,
         max_files: int = MAX_FILES) -> list[Path]:
    """Write the parts and answers.sha256 into `out`; return the files written."""
    if part_bytes <= 0 or max_files < 2:
        raise Refused(f"parts of {part_bytes} bytes, room for {max_files} files: the parts need a size above 0 and "
                      f"at least 2 files (a part and {SUMS})")
    datasets = regenerated_datasets(results, wanted)
    print(f"packing {len(datasets)} datasets of {results}: " +
          ", ".join(f"{name} ({mib(jsonl.stat().st_size)})" for name, (jsonl, _) in datasets.items()), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".packing-", dir=out))  # the final names only once all is written
    try:
        with tarfile.open(staging / STREAM, "w:xz", format=tarfile.PAX_FORMAT) as tar:
            for path in (path for pair in datasets.values() for path in pair):
                tar.add(path, arcname=path.name, recursive=False)
        total = (staging / STREAM).stat().st_size
        parts = max(1, math.ceil(total / part_bytes))
        if parts + 1 > max_files:
            fit = math.ceil(total / (max_files - 1) / MIB * 100) / 100
            raise Refused(
                f"{STREAM} is {mib(total)}: {parts} parts of at most {mib(part_bytes)} and {SUMS} are {parts + 1} "
                f"files, more than the {max_files} allowed (--max-files; a lent machine's $OUT brings back 8 files "
                f"of at most {MAX_PART_MIB} MiB, the run's own among them). Parts of {fit:g} MiB (--part-mib {fit:g}) "
                f"would fit{'' if fit <= MAX_PART_MIB else ', but $OUT brings back none that large'}; else pack some "
                f"datasets at a time (--datasets, in separate sessions or calls; these are: {','.join(datasets)})")
        written = [out / f"{PART}{i:02d}" for i in range(parts)] + [out / SUMS]
        sums = []
        with open(staging / STREAM, "rb") as stream:
            for part in written[:-1]:
                data = stream.read(part_bytes)
                (staging / part.name).write_bytes(data)
                sums.append(f"{hashlib.sha256(data).hexdigest()}  {part.name}")
        sums.append(f"{sha256_file(staging / STREAM)}  {STREAM}")
        (staging / SUMS).write_text("\n".join(sums) + "\n")
        for stale in out.glob(PART + "*"):  # a larger earlier pack's parts would not match answers.sha256
            stale.unlink()
        for path in written:
            os.replace(staging / path.name, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"{STREAM}: {mib(total)} in {out}: " + ", ".join(f"{p.name} ({p.stat().st_size} bytes)" for p in written))
    if part_bytes > MAX_PART_MIB * MIB:
        print(f"note: parts above {MAX_PART_MIB} MiB do not come back from a lent machine's $OUT")
    return written


def read_sums(path: Path) -> dict[str, str]:
    """File name -> sha256 of one answers.sha256: the parts in the stream's order, then the whole stream."""
    lines = [re.fullmatch(rf"([0-9a-f]{{64}}) [ *]({re.escape(PART)}\d+|{re.escape(STREAM)})", line.strip())
             for line in path.read_text().splitlines()]
    sums = {m.group(2): m.group(1) for m in lines if m}
    if not all(lines) or STREAM not in sums or len(sums) < 2:
        raise Refused(f"{path}: not as pack writes it (`<sha256>  {PART}NN` lines, then one for {STREAM})")
    return sums


def gather(dirs: list[Path]) -> list[tuple[list[Path], str]]:
    """Each pack in the folders as (its parts in order, its whole stream's sha256). A pack is one answers.sha256 (the
    same file in several folders is one pack); its parts may lie in any of the folders, each found by its name and
    sha256, so that packs of different sessions (--datasets, each with a part_00) come in together."""
    for d in dirs:
        if not d.is_dir():
            raise Refused(f"{d}: no such folder")
    where = ", ".join(map(str, dirs))
    sums_files = {(d / SUMS).read_bytes(): d / SUMS for d in dirs if (d / SUMS).is_file()}
    if not sums_files:
        raise Refused(f"no {SUMS} in {where} (pack writes it beside the parts)")
    packs = [(path, read_sums(path)) for path in sums_files.values()]
    carried = {(p.name, sha256_file(p)): p for d in dirs for p in sorted(d.glob(PART + "*"))}
    named = {item for _, sums in packs for item in sums.items()}
    for (name, sha), path in carried.items():  # each part carried, each copy too, is one that a pack names
        listed_in = ", ".join(str(f) for f, sums in packs if name in sums)
        if (name, sha) not in named:
            raise Refused(f"{path}: sha256 {sha} differs from {name}'s in {listed_in} (a part cut short or changed "
                          f"in transit: bring {name} again; or one of another pack: bring its {SUMS} too)"
                          if listed_in else
                          f"{path} is named in no {SUMS} of {where}: a part of another pack (bring its {SUMS} too)")
    found = []
    for sums_file, sums in packs:
        whole = sums.pop(STREAM)
        missing = [name for name, sha in sums.items() if (name, sha) not in carried]
        if missing:
            raise Refused(f"missing: {', '.join(missing)}; {sums_file} names {len(sums)} parts "
                          f"({next(iter(sums))} .. {list(sums)[-1]}); looked in {where}")
        found.append(([carried[item] for item in sums.items()], whole))
    return found


def overlay_datasets(unpacked: dict[str, Path], configs: list[str]) -> tuple[dict, list[str]]:
    """The overlay's datasets map and notes: each unpacked dataset as a local file; with `configs`, their datasets
    in their order, a carried one replaced (its keep_cut_answers kept), the others as they are."""
    earlier = (merge_files(configs).get("datasets") or {}) if configs else {}
    datasets = {**earlier, **{name: {"source": "local", "path": str(path)} for name, path in unpacked.items()}}
    for name in unpacked:
        if "keep_cut_answers" in earlier.get(name, {}):
            datasets[name]["keep_cut_answers"] = earlier[name]["keep_cut_answers"]
    named = " ".join(configs)
    notes = [f"dataset {name} is regenerated in {named} and was not carried: the target answers it"
             for name, spec in earlier.items() if name not in unpacked and spec.get("regenerate")]
    notes += [f"dataset {name} was carried but is not in {named}: listed as well"
              for name in unpacked if configs and name not in earlier]
    return datasets, notes


def unpack(dirs: list[Path], into: Path, overlay: Path, configs: list[str] | None = None) -> dict:
    """Check and extract every pack (into a folder beside the files first), write the overlay; return its datasets
    map."""
    packs = gather(dirs)
    into.mkdir(parents=True, exist_ok=True)
    staging, names = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=into)), []
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # before 3.10.12: the name check guards
    try:
        for parts, whole in packs:  # each pack's parts joined into one stream, checked, then extracted
            stream, digest = staging / f".{STREAM}", hashlib.sha256()
            with open(stream, "wb") as joined:
                for data in map(Path.read_bytes, parts):
                    digest.update(data)
                    joined.write(data)
            if digest.hexdigest() != whole:
                raise Refused(f"{', '.join(p.name for p in parts)} joined hash to {digest.hexdigest()}, not {whole}")
            with tarfile.open(stream, "r|xz") as tar:
                for member in tar:
                    if not member.isfile() or not MEMBER.fullmatch(member.name) or (staging / member.name).exists():
                        raise Refused(f"{parts[0]}: {member.name!r} is not a regenerated dataset's file, or is one "
                                      "twice (only <name>.jsonl and <name>.stats.json, each once, are unpacked)")
                    tar.extract(member, staging, **safe)
                    names.append(member.name)
        for name in names:  # all or none under the final names
            os.replace(staging / name, into / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    unpacked = {MEMBER.fullmatch(n).group(1): (into / n).resolve() for n in names if n.endswith(".jsonl")}
    unstated = [str(path) for path in unpacked.values() if read_regenerate_stats(path) is None]
    if unstated:
        print(f"note: no stats describe {', '.join(unstated)}, so the prepared stats will lack regenerate's counts")
    datasets, notes = overlay_datasets(unpacked, configs or [])
    schema = yaml.safe_load(SCHEMA.read_text())
    validator = Draft202012Validator({"definitions": schema["definitions"], **schema["properties"]["datasets"]})
    problems = [f"datasets.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(datasets)]
    if problems:
        raise Refused("the overlay's datasets do not pass the config schema:\n  " + "\n  ".join(problems))
    kept = f"those of {' '.join(configs)}" if configs else "not kept"
    header = ["# Written by `python -m perf carried_answers unpack`: datasets a target answered on another machine",
              "# (rule regenerate) as local files; prepare_dataset reads the <name>.stats.json beside each. This file",
              "# lists `datasets`, so it replaces the whole datasets map of the config files before it (README.md,",
              f"# \"Layering configs\"): give it last. The other datasets and keep_cut_answers: {kept}. From:"]
    for parts, whole in packs:
        came_from = ", ".join(sorted({str(p.parent) for p in parts}))
        header.append(f"#   {parts[0].name} .. {parts[-1].name} ({len(parts)} parts, in {came_from}; "
                      f"{STREAM} sha256 {whole})")
    write_text(overlay, "\n".join(header) + "\n" + yaml.safe_dump({"datasets": datasets}, sort_keys=False))
    for note in notes:
        print(f"note: {note}")
    print(f"{', '.join(unpacked)} unpacked into {into}; overlay {overlay} (give it last)")
    return datasets


def main(argv=None):
    ap = parser(__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="the regenerated answers of a results directory into parts")
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, required=True, help="where the parts and answers.sha256 go")
    p.add_argument("--part-mib", type=float, default=15.0, help="largest part in MiB (15: $OUT brings back 16)")
    p.add_argument("--datasets", help="comma-separated: only these (default: every regenerated one)")
    p.add_argument("--max-files", type=int, default=MAX_FILES, help="most parts and answers.sha256 (8: $OUT's)")
    u = sub.add_parser("unpack", help="parts into files and a config overlay naming them")
    u.add_argument("dirs", nargs="+", type=Path, help="folders holding the parts and answers.sha256")
    u.add_argument("--into", type=Path, required=True, help="where the datasets' files go")
    u.add_argument("--overlay", type=Path, required=True, help="the config overlay to write (YAML)")
    u.add_argument("--configs", nargs="+", default=[], help="the configs before the overlay: their datasets are kept")
    args = ap.parse_args(argv)
    try:
        if args.command == "pack":
            wanted = [d.strip() for d in args.datasets.split(",") if d.strip()] if args.datasets else None
            pack(args.results, args.out, int(args.part_mib * MIB), wanted, args.max_files)
        else:
            unpack(args.dirs, args.into.resolve(), args.overlay, args.configs)
    except Refused as e:
        sys.exit(f"carried_answers {args.command}: {e}")


if __name__ == "__main__":
    main()
