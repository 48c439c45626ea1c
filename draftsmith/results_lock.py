"""One run at a time per results tree.

Snakemake's own lock lives in the working directory (.snakemake/locks), so two working directories whose
configs name one `results:` path would both run, train into the same state and leave a draft of mixed
provenance. The main Snakemake process therefore holds an exclusive flock on `<results>/.draftsmith.lock`
from the start of its jobs to its exit (the Snakefile's `onstart:` takes it; `onsuccess:` / `onerror:` let it
go). Snakemake calls none of these hooks in a dry run (-n), under --lint, or in the jobs it spawns (they get
--no-hooks), so those never take the lock.

The lock is the flock, not the file: the kernel drops it when the holding process dies (a killed run
never blocks the next one), and the file stays behind, holding the last holder's pid, host and working
directory, which the refusal message names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = ".draftsmith.lock"

log = logging.getLogger(__name__)

# lock file path -> the open descriptor that holds its flock (kept open for the life of the process)
_held: dict[str, int] = {}


class ResultsLockedError(RuntimeError):
    """Another live process holds the results tree's lock; the message names both and what to do."""


def lock_path(results: str | Path) -> Path:
    return Path(os.path.abspath(results)) / LOCK_FILE


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict):
        return "a process that has not recorded itself yet"
    return (f"pid {info.get('pid')} on {info.get('host')}, working directory {info.get('workdir')}, "
            f"since {info.get('started')}")


def acquire(results: str | Path, workdir: str | Path | None = None) -> Path | None:
    """Take the exclusive lock on the results tree `results` for this process, or raise ResultsLockedError.

    Idempotent within one process. A refused run changes nothing: the lock file, when it exists, is opened
    but never written. Returns the lock file, or None where the filesystem has no flock (logged).
    """
    path = lock_path(results)
    if str(path) in _held:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # O_CLOEXEC: jobs Snakemake starts must not inherit the lock (and keep it after the run is killed)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        try:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ResultsLockedError(
                    f"results tree {path.parent} is in use by another run ({_holder(fd)}; lock file {path}): wait "
                    "for it to finish, or give this run its own `results:` path. Nothing was changed."
                ) from None
            log.warning("cannot lock %s (%s): concurrent runs on this results tree will not be detected", path,
                        os.strerror(e.errno or 0))
            return None
        finally:
            os.close(fd)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "workdir": str(workdir or os.getcwd()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held[str(path)] = fd
    return path


def release(results: str | Path) -> None:
    """Let the lock go (the process's exit does the same)."""
    fd = _held.pop(str(lock_path(results)), None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
