"""Pin each GPU job to its own GPUs on a shared machine.

Snakemake's `--resources gpu=N` cap bounds how many GPUs running jobs use together, but a local
job is not told which GPUs are free. A job claims GPU indices among the visible ones with
non-blocking file locks (released by the kernel when the process dies, SIGKILL included) and
sets CUDA_VISIBLE_DEVICES before CUDA initialises. A job that finds too few free GPUs waits.
Under SLURM each job sees only its allocation, so the same code picks from that.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)


def visible_devices() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def lock_dir() -> Path:
    path = Path(os.environ.get("DRAFTSMITH_GPU_LOCK_DIR", Path(tempfile.gettempdir()) / "draftsmith-gpu-locks"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def claim_gpus(n: int, poll_s: float = 2.0) -> Iterator[list[str]]:
    """Hold `n` free visible GPUs for the duration of the block; yields their ids ([] if n == 0 or no GPU)."""
    devices = visible_devices()
    if n <= 0 or not devices:
        if n > 0:
            log.warning("rule asks for %d GPU(s) but none is visible; running without GPU pinning", n)
        yield []
        return
    if n > len(devices):
        raise RuntimeError(f"rule needs {n} GPUs but only {len(devices)} are visible ({','.join(devices)})")
    directory = lock_dir()
    waited = False
    while True:
        held = []
        for device in devices:
            f = open(directory / f"gpu-{device}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            held.append((device, f))
            if len(held) == n:
                break
        if len(held) == n:
            break
        for _, f in held:
            f.close()
        if not waited:
            log.info("waiting for %d free GPU(s) of %s", n, ",".join(devices))
            waited = True
        time.sleep(poll_s)
    claimed = [d for d, _ in held]
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(claimed)
    log.info("pinned to GPU(s) %s", ",".join(claimed))
    try:
        yield claimed
    finally:
        for _, f in held:
            f.close()
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
