"""Air-gapped install: `make wheelhouse` then `make install-offline` for the whole core env.

The round trip downloads every pin of envs/core.lock.txt for manylinux_2_28_x86_64 / Python 3.11
(torch: the local CPU build this machine's pip finds), builds the sdist-only ones into wheels,
installs them into a fresh venv with no network (`unshare -n` where allowed, `--no-index` always,
pip's own config and find-links turned off), and imports draftsmith, speculators and snakemake
there. It takes about 3-4 minutes on a 2-core machine, most of it installing torch. Skipped only
when PyPI cannot be reached, with the reason printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

PYPI = "https://pypi.org/simple/pip/"


def pypi_unreachable() -> str | None:
    try:
        urllib.request.urlopen(PYPI, timeout=20).close()
    except OSError as err:
        return f"PyPI unreachable ({PYPI}: {err}); the wheelhouse round trip needs it"
    return None


def no_network_prefix() -> list[str]:
    """Run in a network namespace of its own (no route anywhere) where this user may."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-n"]
    return []


def make(*args: str, env: dict, prefix: list[str] = ()) -> None:
    proc = subprocess.run([*prefix, "make", "-C", str(REPO), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"make {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def locked_pins(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_core_wheelhouse_installs_and_imports_offline(tmp_path, capsys):
    reason = pypi_unreachable()
    if reason:
        with capsys.disabled():
            print(f"\nSKIPPED test_wheelhouse: {reason}", flush=True)
        pytest.skip(reason)

    wheelhouse, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    env = {**os.environ}
    make("wheelhouse", "ENV=core", f"WHEELHOUSE={wheelhouse}", f"VENV={sys.prefix}", env=env)
    wheels = sorted(p.name for p in wheelhouse.iterdir())
    assert not [w for w in wheels if w.endswith((".tar.gz", ".zip"))], "sdists are built into wheels"
    assert any(w.startswith("deepspeed-0.19.8-") and w.endswith(".whl") for w in wheels), "an sdist-only pin"

    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    offline["PIP_CONFIG_FILE"] = os.devnull  # no extra indexes or find-links from this machine's pip config
    prefix = no_network_prefix()
    make("install-offline", "ENV=core", f"WHEELHOUSE={wheelhouse}", f"VENV={venv}", env=offline, prefix=prefix)

    python = str(venv / "bin" / "python")
    proc = subprocess.run([*prefix, python, "-c", "import draftsmith, speculators, snakemake; print(draftsmith.__file__)"],
                          capture_output=True, text=True, env=offline)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert Path(proc.stdout.strip()) == REPO / "draftsmith" / "__init__.py"

    freeze = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                            env=offline, check=True).stdout
    installed = {}
    for line in freeze.splitlines():
        if "==" in line:
            name, version = line.split("==")
            installed[name.lower().replace("_", "-")] = version.split("+")[0]  # torch 2.13.0+cpu is torch 2.13.0
    wrong = {name: (version, installed.get(name)) for name, version in locked_pins(REPO / "envs" / "core.lock.txt").items()
             if installed.get(name) != version}
    assert not wrong, f"installed versions differ from envs/core.lock.txt (pin, installed): {wrong}"
