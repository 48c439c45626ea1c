"""Devices: which GPUs exist and are free, and which torch device and dtype a stage runs on.

Pinning: Snakemake's `--resources gpu=N` cap bounds how many GPUs running jobs use together, but a local
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
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)


def nvidia_smi_gpus() -> list[str]:
    """Names of the machine's GPUs as nvidia-smi lists them (no CUDA initialisation); [] without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_memory_bytes() -> int | None:
    """Total memory of the first visible GPU as nvidia-smi reports it (no CUDA initialisation); None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = _first_visible_index()
    return int(float(out[first])) * 2**20 if first < len(out) else None


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _env_devices() -> list[str] | None:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return None
    return [d.strip() for d in env.split(",") if d.strip() not in ("", "-1")]


def visible_devices() -> list[str]:
    """Ids of the GPUs this process may use: CUDA_VISIBLE_DEVICES where set, else every GPU nvidia-smi lists."""
    env = _env_devices()
    return env if env is not None else [str(i) for i in range(len(nvidia_smi_gpus()))]


def visible_gpu_count() -> int:
    """GPUs that exist and that CUDA_VISIBLE_DEVICES lets this process see."""
    physical = len(nvidia_smi_gpus())
    env = _env_devices()
    return physical if env is None else min(physical, len(env))


def gpu_name() -> str | None:
    """The name of the first visible GPU, or None."""
    names = nvidia_smi_gpus()
    first = _first_visible_index()
    return names[first] if first < len(names) else None


def _first_visible_index() -> int:
    """nvidia-smi's index of the first GPU CUDA_VISIBLE_DEVICES lets this process see (0 where it is unset)."""
    env = _env_devices()
    return int(env[0]) if env and env[0].isdigit() else 0


def resolve_device(device: str):
    """`auto` is the first CUDA device where one exists, else the CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device):
    """`auto` is bfloat16 on a GPU and float32 on the CPU."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


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
