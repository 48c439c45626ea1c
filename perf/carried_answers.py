"""Carry a run's regenerated answers from the machine where the target wrote them to one where the draft trains.

pack: RESULTS/data/regenerated/<name>.jsonl and the <name>.stats.json beside each (what rule regenerate wrote) as
one tar, xz-compressed as it is written, cut into answers.tar.xz.part_00, _01, ... of at most --part-mib MiB, and
answers.sha256 (sha256sum's format: each part, and the whole stream as answers.tar.xz). At most --max-files files
in all (8: what a lent GPU machine's $OUT brings back); more is refused before anything is written under the final
names.

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
import io
import json
import lzma
import math
import os
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import yaml

from perf.common import parser

STREAM = "answers.tar.xz"
PART = STREAM + ".part_"
SUMS = "answers.sha256"
MAX_FILES = 8  # a lent machine's $OUT brings back at most 8 files, 16 MiB each
MAX_PART_MIB = 16
NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # a dataset's name (the config schema's propertyNames)
MEMBER = re.compile(r"^([A-Za-z0-9_-]+)(\.jsonl|\.stats\.json)$")
MIB = 1 << 20
BLOCK = 1 << 20


class Refused(Exception):
    pass


def mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"


# ----------------------------------------------------------------------------- pack

class PartWriter(io.RawIOBase):
    """A writable stream that cuts what it is given into files of at most `part_bytes` in `out`, under temporary
    names, hashing each and the whole. Past `max_parts` parts it only counts (so that a refusal can say the size)."""

    def __init__(self, out: Path, part_bytes: int, max_parts: int):
        self.out, self.part_bytes, self.max_parts = out, part_bytes, max_parts
        self.whole = hashlib.sha256()
        self.total = 0
        self.parts: list[tuple[Path, str, int]] = []  # (temporary path, sha256, bytes) of each finished part
        self.temps: list[Path] = []
        self._file = self._hash = None
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        n = len(data)
        self.whole.update(data)
        self.total += n
        while len(data):
            if self._hash is None:
                self._open()
            take = min(len(data), self.part_bytes - self._size)
            self._hash.update(data[:take])
            if self._file is not None:
                self._file.write(data[:take])
            self._size += take
            data = data[take:]
            if self._size == self.part_bytes:
                self._finish()
        return n

    def _open(self) -> None:
        index = len(self.parts)
        if index < self.max_parts:
            fd, tmp = tempfile.mkstemp(prefix=f".{PART}{index:02d}.", suffix=".tmp", dir=self.out)
            self._file = os.fdopen(fd, "wb")
            self.temps.append(Path(tmp))
        self._hash, self._size = hashlib.sha256(), 0

    def _finish(self) -> None:
        path = None
        if self._file is not None:
            self._file.close()
            path = self.temps[-1]
        self.parts.append((path, self._hash.hexdigest(), self._size))
        self._file = self._hash = None

    def close(self) -> None:
        if self._hash is not None:
            self._finish()
        super().close()

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
        for tmp in self.temps:
            tmp.unlink(missing_ok=True)


def regenerated_datasets(results: Path, wanted: list[str] | None) -> dict[str, tuple[Path, Path]]:
    """name -> (its answers, its stats) under results/data/regenerated, checked: the stats describe the file."""
    from draftsmith.data.regenerated import read_regenerate_stats, regenerate_stats_path

    folder = results / "data" / "regenerated"
    found = {p.name.removesuffix(".jsonl"): p for p in sorted(folder.glob("*.jsonl"))
             if NAME.match(p.name.removesuffix(".jsonl"))}
    if not found:
        raise Refused(f"{folder}: no regenerated answers (<name>.jsonl); rule regenerate writes them")
    missing = [name for name in wanted or [] if name not in found]
    if missing:
        raise Refused(f"{folder}: no answers for {', '.join(missing)} (there are: {', '.join(found)})")
    datasets = {}
    for name in wanted or found:
        jsonl, stats = found[name], regenerate_stats_path(found[name])
        problem = None
        if not stats.is_file():
            problem = f"{jsonl}: no {stats.name} beside it (rule regenerate writes both; did it finish?)"
        elif read_regenerate_stats(jsonl) is None:
            problem = (f"{stats} does not describe {jsonl} (its output_sha256 differs: a file changed after "
                       "regenerate wrote it, or it did not finish)")
        if problem and wanted:
            raise Refused(problem)
        if problem:  # a run cut short: the datasets it finished are carried
            print(f"note: {problem}: left out")
            continue
        datasets[name] = (jsonl, stats)
    if not datasets:
        raise Refused(f"{folder}: no finished dataset (each needs its <name>.stats.json, matching)")
    return datasets


def describe(name: str, jsonl: Path, stats_path: Path) -> str:
    with open(jsonl, "rb") as f:
        records = sum(block.count(b"\n") for block in iter(lambda: f.read(BLOCK), b""))
    stats = json.loads(stats_path.read_text())
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats.get("finish_reasons", {}).items()))
    return (f"  {name}: {records} records, {stats.get('num_answers', '?')} answers ({reasons or 'no finish reasons'}), "
            f"{stats.get('new_tokens', '?')} new tokens, {mib(jsonl.stat().st_size)}")


def _member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644
    return info


def pack(results: Path, out: Path, part_bytes: int, wanted: list[str] | None = None,
         max_files: int = MAX_FILES) -> list[Path]:
    """Write the parts and answers.sha256 into `out`; return the files written."""
    if part_bytes <= 0:
        raise Refused("the part size must be above 0")
    if max_files < 2:
        raise Refused(f"room for {max_files} files: the parts need at least 2 (a part and {SUMS})")
    datasets = regenerated_datasets(results, wanted)
    print(f"packing {len(datasets)} datasets of {results}:")
    for name, (jsonl, stats) in datasets.items():
        print(describe(name, jsonl, stats), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    parts = PartWriter(out, part_bytes, max_files - 1)
    try:
        with lzma.LZMAFile(parts, "w", format=lzma.FORMAT_XZ, preset=6) as xz:
            with tarfile.open(fileobj=xz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for name, (jsonl, stats) in datasets.items():
                    tar.add(jsonl, arcname=jsonl.name, recursive=False, filter=_member)
                    tar.add(stats, arcname=stats.name, recursive=False, filter=_member)
        parts.close()
        files = len(parts.parts) + 1
        if files > max_files:
            fit = math.ceil(parts.total / (max_files - 1) / MIB * 100) / 100
            larger = (f"parts of {fit:g} MiB (--part-mib {fit:g}) would fit" if fit <= MAX_PART_MIB
                      else f"even parts of {MAX_PART_MIB} MiB (the most $OUT brings back) would not fit")
            raise Refused(
                f"{STREAM} is {mib(parts.total)}: {len(parts.parts)} parts of at most {mib(part_bytes)} and {SUMS} "
                f"are {files} files, more than the {max_files} allowed (--max-files; a lent machine's $OUT brings "
                f"back 8 files of at most 16 MiB, the run's own among them). {larger}; else pack some datasets at "
                f"a time (--datasets, in separate sessions or calls; these are: {','.join(datasets)})")
        sums = [f"{sha}  {PART}{i:02d}" for i, (_, sha, _) in enumerate(parts.parts)]
        sums.append(f"{parts.whole.hexdigest()}  {STREAM}")
        fd, sums_tmp = tempfile.mkstemp(prefix=f".{SUMS}.", suffix=".tmp", dir=out)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(sums) + "\n")
        parts.temps.append(Path(sums_tmp))
    except BaseException:
        parts.discard()
        raise
    for stale in out.glob(PART + "*"):  # a larger earlier pack's parts would not match answers.sha256
        stale.unlink()
    written = []
    for i, (tmp, _, _) in enumerate(parts.parts):
        written.append(out / f"{PART}{i:02d}")
        os.replace(tmp, written[-1])
    written.append(out / SUMS)
    os.replace(sums_tmp, written[-1])
    for path in written:
        path.chmod(0o644)
    raw = sum(p.stat().st_size for pair in datasets.values() for p in pair)
    print(f"{STREAM}: {mib(parts.total)} ({mib(raw)} before xz), {len(parts.parts)} parts of at most "
          f"{mib(part_bytes)}, in {out}:")
    for path in written:
        print(f"  {path.name}  {path.stat().st_size} bytes")
    if part_bytes > MAX_PART_MIB * MIB:
        print(f"note: parts above {MAX_PART_MIB} MiB do not come back from a lent machine's $OUT")
    return written


# ----------------------------------------------------------------------------- unpack

def read_sums(path: Path) -> tuple[dict[str, str], str]:
    """(part name -> sha256, the whole stream's sha256) of one answers.sha256."""
    sums, whole = {}, None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        m = re.fullmatch(r"([0-9a-f]{64}) [ *](\S+)", line.strip())
        if not m:
            raise Refused(f"{path}: line {number} is not `<sha256>  <file>`: {line!r}")
        if m.group(2) == STREAM:
            whole = m.group(1)
        elif m.group(2).startswith(PART):
            sums[m.group(2)] = m.group(1)
    if whole is None or not sums:
        raise Refused(f"{path}: names no parts or no {STREAM} line")
    return sums, whole  # in the order pack wrote them: the order of the stream


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def gather(dirs: list[Path]) -> list[tuple[list[Path], str, Path]]:
    """Each pack in the folders, as (its parts in order, its whole stream's sha256, its answers.sha256). A pack is
    one answers.sha256 (the same file in several folders is one pack); its parts may lie in any of the folders, each
    found by its name and sha256, so that packs of different sessions (--datasets) come in together."""
    for d in dirs:
        if not d.is_dir():
            raise Refused(f"{d}: no such folder")
    where = ", ".join(map(str, dirs))
    distinct: dict[bytes, Path] = {}
    for d in dirs:
        if (d / SUMS).is_file():
            distinct.setdefault((d / SUMS).read_bytes(), d / SUMS)
    if not distinct:
        raise Refused(f"no {SUMS} in {where} (pack writes it beside the parts)")
    packs = [(path, *read_sums(path)) for path in distinct.values()]
    listed = {(name, sha): path for path, sums, _ in packs for name, sha in sums.items()}
    files = {p: file_sha256(p) for d in dirs for p in sorted(d.glob(PART + "*"))}
    for path, sha in files.items():  # every part carried, each copy too, is one that a pack names
        if (path.name, sha) in listed:
            continue
        expected = [(sums_file, sums[path.name]) for sums_file, sums, _ in packs if path.name in sums]
        if not expected:
            raise Refused(f"{path} is named in no {SUMS} of {where}: a part of another pack")
        raise Refused(f"{path}: sha256 {sha} differs from {expected[0][1]} in {expected[0][0]} (a part cut short or "
                      f"changed in transit; bring {path.name} again)")
    found = []
    for sums_file, sums, whole in packs:
        parts = {name: next((p for p, sha in files.items() if p.name == name and sha == expected), None)
                 for name, expected in sums.items()}
        missing = [name for name, path in parts.items() if path is None]
        if missing:
            raise Refused(f"missing: {', '.join(missing)}; {sums_file} names {len(sums)} parts "
                          f"({next(iter(sums))} .. {list(sums)[-1]}); looked in {where}")
        found.append((list(parts.values()), whole, sums_file))
    return found


class Parts(io.RawIOBase):
    """The parts read one after another as one stream, hashed as read."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)
        self.hash = hashlib.sha256()
        self._file = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._file is None:
                if not self.paths:
                    return 0
                self._file = open(self.paths.pop(0), "rb")
            n = self._file.readinto(buffer)
            if n:
                self.hash.update(memoryview(buffer)[:n])
                return n
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


def extract(parts: list[Path], whole: str, staging: Path) -> list[str]:
    """The files of one pack's parts extracted into `staging`; their names. The stream must hash to `whole`."""
    stream = Parts(parts)
    names = []
    with lzma.LZMAFile(io.BufferedReader(stream, BLOCK)) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        for member in tar:
            if not member.isfile() or not MEMBER.match(member.name) or (staging / member.name).exists():
                raise Refused(f"{parts[0]}: {member.name!r} is not a regenerated dataset's file, or is one twice "
                              "(only <name>.jsonl and <name>.stats.json, each once, are unpacked)")
            names.append(member.name)
            if hasattr(tarfile, "data_filter"):
                tar.extract(member, staging, filter="data")
            else:  # Python before 3.11.4: the name check above is the guard
                tar.extract(member, staging)
        # the end of the stream, so that the whole is hashed (tar stops reading at its end-of-archive blocks)
        while xz.read(BLOCK):
            pass
    if stream.hash.hexdigest() != whole:
        raise Refused(f"{', '.join(p.name for p in parts)} joined hash to {stream.hash.hexdigest()}, not {whole}")
    if not any(n.endswith(".jsonl") for n in names):
        raise Refused(f"{parts[0]}: its pack holds no <name>.jsonl")
    return names


def extract_all(packs: list[tuple[list[Path], str, Path]], into: Path) -> dict[str, Path]:
    """Every pack's files extracted into `into`, all or none (extracted beside them first); dataset -> its jsonl."""
    into.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=into))
    try:
        names = [name for parts, whole, _ in packs for name in extract(parts, whole, staging)]
        for name in names:
            os.replace(staging / name, into / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {MEMBER.match(n).group(1): (into / n).resolve() for n in names if n.endswith(".jsonl")}


def check_datasets(datasets: dict) -> list[str]:
    """Problems of a `datasets` map against the config schema (none where jsonschema is not installed)."""
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        return []
    from draftsmith.config.workflow import SCHEMA

    schema = yaml.safe_load(Path(SCHEMA).read_text())
    section = {"definitions": schema["definitions"], **schema["properties"]["datasets"]}
    return [f"datasets.{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in Draft202012Validator(section).iter_errors(datasets)]


def overlay_datasets(unpacked: dict[str, Path], configs: list[str]) -> tuple[dict, list[str]]:
    """The overlay's datasets map and notes: each unpacked dataset as a local file; with `configs`, their datasets
    in their order, a carried one replaced (its keep_cut_answers kept), the others as they are."""
    notes = []
    earlier = {}
    if configs:
        from draftsmith.config.workflow import merge_files

        earlier = merge_files(configs).get("datasets") or {}
    datasets = {}
    for name, spec in earlier.items():
        if name in unpacked:
            datasets[name] = {"source": "local", "path": str(unpacked[name])}
            if "keep_cut_answers" in spec:
                datasets[name]["keep_cut_answers"] = spec["keep_cut_answers"]
        else:
            datasets[name] = spec
            if spec.get("regenerate"):
                notes.append(f"dataset {name} is regenerated in {' '.join(configs)} and was not carried: the target "
                             "answers it here")
    for name, path in unpacked.items():
        if name not in datasets:
            datasets[name] = {"source": "local", "path": str(path)}
            if configs:
                notes.append(f"dataset {name} was carried but is not in {' '.join(configs)}: listed as well")
    return datasets, notes


def unpack(dirs: list[Path], into: Path, overlay: Path, configs: list[str] | None = None) -> dict:
    """Check, extract and write the overlay; return its datasets map."""
    from draftsmith.data.regenerated import read_regenerate_stats

    packs = gather(dirs)
    unpacked = extract_all(packs, into)
    for name, path in unpacked.items():
        stats = read_regenerate_stats(path)
        if stats is None:
            print(f"note: {path}: no stats describe it, so the prepared stats will lack regenerate's counts")
        print(f"  {name}: {path} ({mib(path.stat().st_size)}"
              f"{', %s answers' % stats.get('num_answers') if stats else ''})")
    datasets, notes = overlay_datasets(unpacked, configs or [])
    problems = check_datasets(datasets)
    if problems:
        raise Refused("the overlay's datasets do not pass the config schema:\n  " + "\n  ".join(problems))
    header = ["# Datasets of answers a target wrote on another machine (rule regenerate), as local files: written by",
              "# `python -m perf carried_answers unpack` from"]
    for parts, whole, _ in packs:
        came_from = ", ".join(sorted({str(p.parent) for p in parts}))
        header += [f"#   {parts[0].name} .. {parts[-1].name} ({len(parts)} parts, in {came_from};",
                   f"#   {STREAM} sha256 {whole})"]
    header += [
        "# prepare_dataset reads each as it reads regenerate's output, and its stats carry regenerate's (the",
        "# <name>.stats.json beside each file).",
        "# This file lists `datasets`, so it replaces the whole datasets map of the config files before it (README.md,",
        "# \"Layering configs\"): give it after them, last (--configfile <the run's configs> this-file.yaml).",
    ]
    if configs:
        header.append(f"# The other datasets and keep_cut_answers are those of {' '.join(configs)}.")
    else:
        header.append("# Only the carried datasets: others of the configs before it, and their keep_cut_answers, are"
                      " not kept.")
    overlay.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(header) + "\n" + yaml.safe_dump({"datasets": datasets}, sort_keys=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{overlay.name}.", suffix=".tmp", dir=overlay.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, overlay)
    for note in notes:
        print(f"note: {note}")
    print(f"{len(unpacked)} datasets unpacked into {into}; overlay {overlay} (give it last)")
    return datasets


# ----------------------------------------------------------------------------- command line

def main(argv=None):
    ap = parser(__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="the regenerated answers of a results tree into parts")
    p.add_argument("results", type=Path, help="a results directory (config `results:`)")
    p.add_argument("--out", type=Path, required=True, help="where the parts and answers.sha256 go")
    p.add_argument("--part-mib", type=float, default=15.0,
                   help="largest part in MiB (15; a lent machine's $OUT brings back files of at most 16)")
    p.add_argument("--datasets", help="comma-separated: only these datasets (default: every regenerated one)")
    p.add_argument("--max-files", type=int, default=MAX_FILES,
                   help="refuse when the parts and answers.sha256 are more files than this (8: $OUT's limit)")
    u = sub.add_parser("unpack", help="parts into files and a config overlay naming them")
    u.add_argument("dirs", nargs="+", type=Path, help="folders holding the parts and answers.sha256")
    u.add_argument("--into", type=Path, required=True, help="where the datasets' files go")
    u.add_argument("--overlay", type=Path, required=True, help="the config overlay to write (YAML)")
    u.add_argument("--configs", nargs="+", default=[],
                   help="the config files the overlay follows: their other datasets and keep_cut_answers are kept")
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
