"""Inputs by content: the files the workflow reads from outside its results tree (raw datasets, a local target's
files, packaged prompt sets), each identified by the sha256 of its bytes.

Snakemake decides re-runs by modification time, which a `touch` or a copy without `-p` moves without changing a byte,
and which an edit that keeps size and mtime (or `cp -p`, `rsync -a` of an older file) leaves where it was. Rules
therefore declare these inputs `ancient()` and get their sha256 as a param: a changed byte re-runs exactly the jobs
that read the file, a new mtime re-runs nothing.

Hashing every input on every invocation would cost minutes on a large target, so digests are cached in the results
tree, keyed by path, size, mtime, inode and ctime. ctime cannot be set by a user: any write, `touch -d` or rename
moves it, so an edit that restores size and mtime still misses the cache. An entry is trusted only for a file whose
ctime is older than the moment it was hashed by MARGIN_NS (git's "racily clean" rule): a write in the same clock tick
as the hashing, on a filesystem with coarse timestamps, cannot hide behind an equal ctime.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from draftsmith.io import read_json, sha256_bytes, sha256_file, write_json

STATE_DIR = ".draftsmith"
CACHE_NAME = "content_hashes.json"
RUN_NAME = "run.json"
# coarser than any filesystem clock draftsmith meets (FAT's 2 s); an entry younger than this is hashed again
MARGIN_NS = 3_000_000_000


class ContentHashes:
    """sha256 of files, cached in `<results>/.draftsmith/content_hashes.json` (saved by save(); never required);
    without `results`, not cached."""

    def __init__(self, results: str | Path | None = None):
        self.results = Path(results) if results is not None else None
        self.path = self.results / STATE_DIR / CACHE_NAME if self.results is not None else None
        try:
            self.entries = read_json(self.path) if self.path is not None else {}
        except (OSError, ValueError):
            self.entries = {}
        self.dirty = False

    def sha256(self, path: str | Path) -> str:
        st = os.stat(path)
        key = os.path.realpath(path)
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
        entry = self.entries.get(key)
        if entry and entry["stat"] == stamp and entry["hashed_at_ns"] - st.st_ctime_ns > MARGIN_NS:
            return entry["sha256"]
        hashed_at = time.time_ns()  # before reading: a write during the read leaves ctime after it
        digest = sha256_file(path)
        self.entries[key] = {"stat": stamp, "sha256": digest, "hashed_at_ns": hashed_at}
        self.dirty = True
        return digest

    def directory(self, directory: str | Path) -> dict[str, str]:
        """sha256 of each file below `directory` by relative path; dotfiles and dot-directories (Snakemake's timestamp,
        the hub's download cache, the target's own record) are left out."""
        root = Path(directory)
        digests = {}
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(n for n in filenames if not n.startswith(".")):
                digests[str((Path(dirpath) / name).relative_to(root))] = self.sha256(Path(dirpath) / name)
        return digests

    def fingerprint(self, path: str | Path) -> str:
        """One digest for a file or a directory (of its files' digests); "missing" when there is none."""
        if Path(path).is_dir():
            return sha256_bytes(json.dumps(self.directory(path), sort_keys=True).encode())
        return self.sha256(path) if Path(path).exists() else "missing"

    def save(self) -> None:
        """Write the cache where the results tree exists and is writable; a read-only tree is hashed each time."""
        if not self.dirty or self.results is None or not self.results.is_dir():
            return
        try:
            write_json(self.path, self.entries)
            self.dirty = False
        except OSError:
            pass


def results_path(results: str | Path, workdir: str | Path | None = None) -> Path:
    """The one spelling of the results tree that Snakemake sees, whatever the config says: relative to the working
    directory when the tree lies under it (a copied working directory stays valid), else absolute. Snakemake keys
    its records of how each output was made by this spelling."""
    real = Path(os.path.realpath(results))
    base = Path(os.path.realpath(workdir or os.getcwd()))
    try:
        return real.relative_to(base) if real != base else Path(".")
    except ValueError:
        return real


def record_run(results: Path, configfiles: list[str], config: dict) -> None:
    """What a run of the workflow on `results` was given: its working directory and config files, and the merged
    config; `draftsmith validate` reads them when it is given no config. Paths under the working directory are
    recorded relative to it, and the working directory relative to a tree under it, so that a copied working
    directory names itself."""
    workdir = Path(os.path.realpath(os.getcwd()))

    def under_workdir(path: str) -> str:
        real = Path(os.path.realpath(path))
        return str(real.relative_to(workdir)) if real.is_relative_to(workdir) else str(real)

    write_json(results / STATE_DIR / RUN_NAME, {
        "workdir": str(workdir) if results.is_absolute() else os.path.relpath(workdir, workdir / results),
        "configfiles": [under_workdir(f) for f in configfiles],
        "config": config,
    })


def recorded_run(results: str | Path) -> dict | None:
    """record_run's record of the tree, with its working directory and config files as absolute paths."""
    path = Path(results) / STATE_DIR / RUN_NAME
    if not path.is_file():
        return None
    run = read_json(path)
    workdir = Path(os.path.realpath(Path(results) / run["workdir"]))  # an absolute one stays itself
    return {**run, "workdir": str(workdir), "configfiles": [str(workdir / f) for f in run["configfiles"]]}


def other_workdir(results: Path) -> str | None:
    """The working directory another run of an absolute results tree was started from, if not this one: Snakemake's
    records (.snakemake) are there, and a run from here would not see how the outputs were made."""
    if not results.is_absolute():
        return None
    try:
        run = recorded_run(results)
    except (OSError, ValueError):
        return None
    workdir = (run or {}).get("workdir")
    here = os.path.realpath(os.getcwd())
    if workdir and workdir != here and Path(workdir, ".snakemake").is_dir() and not _in_use(results):
        return workdir
    return None


def _in_use(results: Path) -> bool:
    """Whether a run holds the tree's lock (draftsmith.results_lock): its own one-line refusal then speaks."""
    import fcntl

    from draftsmith.results_lock import lock_path

    try:
        fd = os.open(lock_path(results), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)
