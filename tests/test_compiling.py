"""torch.compile's cache under the results tree: a second process compiling the same function takes its graphs
from the cache the first one wrote (real Inductor on the CPU, in fresh processes)."""

import os
import subprocess
import sys

from draftsmith.compiling import CACHE_DIR

COMPILE_ONCE = """
import sys, torch
from draftsmith.compiling import compile_totals, describe, use_results_cache
print(use_results_cache(sys.argv[1]))
before = compile_totals()
compiled = torch.compile(lambda x: (x * 3).cos().sum())
compiled(torch.randn(5, requires_grad=True)).backward()
after = compile_totals()
print(describe(before, after))
print(after["forward_s"] - before["forward_s"] > 0 and after["backward_s"] - before["backward_s"] > 0)
"""


def compile_in_a_fresh_process(results, env_cache=None):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if env_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(env_cache)
    proc = subprocess.run([sys.executable, "-c", COMPILE_ONCE, str(results)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-3:]


def test_a_second_process_reuses_the_graphs_the_first_compiled_under_results(tmp_path):
    cache = tmp_path / "results" / CACHE_DIR
    first = compile_in_a_fresh_process(tmp_path / "results")
    assert first[0] == str(cache) and first[2] == "True"  # forward and backward compile time counted
    assert "0 graphs from the cache" in first[1] and f"({cache})" in first[1]
    assert (cache / "fxgraph").is_dir()
    second = compile_in_a_fresh_process(tmp_path / "results")
    assert " 0 compiled" in second[1] and "0 graphs from the cache" not in second[1]


def test_a_cache_the_user_named_wins(tmp_path):
    mine = tmp_path / "mine"
    out = compile_in_a_fresh_process(tmp_path / "results", env_cache=mine)
    assert out[0] == str(mine) and f"({mine})" in out[1] and not (tmp_path / "results").exists()


def test_torchs_own_default_inherited_from_a_parent_that_compiled_counts_as_unset(tmp_path):
    """torch writes its default cache path into the environment of any process that compiled (a pytest run, a
    Python program driving Snakemake): a rule started from one still uses its results tree's cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    out = compile_in_a_fresh_process(tmp_path / "results", env_cache=default_cache_dir())
    assert out[0] == str(tmp_path / "results" / CACHE_DIR) and (tmp_path / "results" / CACHE_DIR / "fxgraph").is_dir()
