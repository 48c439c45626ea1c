"""torch.compile's on-disk cache and what compiling cost a rule.

Inductor keeps compiled graphs and kernels in a cache keyed by the graph, its settings, the torch and Triton
versions and the device (torch's own keys); by default under /tmp, which a cluster job often starts without. The
rules point it at the results tree instead (a TORCHINDUCTOR_CACHE_DIR the user set wins), so every job that trains or
decodes the same shapes (another variant, a resumed run, a job on another node of a shared filesystem) reuses them.
On an H100 the default SmolLM2 draft's first optimizer step came 295 s into a 566 s training, its cache cold; a later
variant on the same machine (544 steps, the cache warm) trained in 111 s all told.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = Path(".cache") / "torch_compile"
_INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"


def use_results_cache(results: str | Path) -> str:
    """Point Inductor's cache at <results>/.cache/torch_compile unless the environment names one of its own; read
    lazily by torch, so this holds for any compile later in the process (and in processes it starts). torch writes
    its default (/tmp/torchinductor_<user>) into the environment of any process that compiled, so a parent that
    compiled passes that on: it counts as unset, not as a user's choice."""
    if os.environ.get(_INDUCTOR) in (None, _torch_default()):
        os.environ[_INDUCTOR] = str(Path(results).resolve() / CACHE_DIR)
    return os.environ[_INDUCTOR]


def _torch_default() -> str | None:
    try:  # a module without torch dependencies, cheap at a rule's start; private, so probed
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def compile_totals() -> dict[str, float] | None:
    """This process's totals so far: seconds compiling forward graphs (tracing included) and backward graphs, and
    graphs Inductor took from its cache or compiled. From Dynamo's counters (a private API, so probed: None where
    this torch lacks them)."""
    try:
        from torch._dynamo.utils import compile_times, counters

        names, values = compile_times(repr="csv", aggregate=True)
    except (ImportError, TypeError, ValueError):
        return None
    times = dict(zip(names, (float(v) for v in values)))
    inductor = counters["inductor"]
    return {"forward_s": times.get("_compile.compile_inner", 0.0),
            "backward_s": times.get("compile_fx.<locals>.bw_compiler", 0.0),
            "reused": float(inductor["fxgraph_cache_hit"]), "compiled": float(inductor["fxgraph_cache_miss"])}


def describe(before: dict[str, float], after: dict[str, float]) -> str:
    """The compiling between two compile_totals() readings, as one log line."""
    d = {k: after[k] - before[k] for k in after}
    return (f"torch.compile: {d['forward_s']:.1f} s compiling forward graphs, {d['backward_s']:.1f} s backward "
            f"graphs; {d['reused']:.0f} graphs from the cache, {d['compiled']:.0f} compiled "
            f"({os.environ.get(_INDUCTOR, 'the default cache')})")
