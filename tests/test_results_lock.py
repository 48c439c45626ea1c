"""One run at a time per results tree (draftsmith.results_lock, taken by the Snakefile's onstart)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, SNAKEMAKE, snakemake, write_config

from draftsmith import results_lock

# A process that takes the lock, starts a long-lived child (as Snakemake starts jobs), and waits.
HOLDER = """
import subprocess, sys, time
from draftsmith import results_lock
results_lock.acquire(sys.argv[1])
child = subprocess.Popen(["sleep", "300"], close_fds=False)
print(child.pid, flush=True)
time.sleep(300)
"""


def test_lock_names_its_holder_and_a_killed_holder_does_not_block(tmp_path):
    results = tmp_path / "results"
    holder_dir = tmp_path / "holder"
    holder_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(results)], cwd=holder_dir, env=env,
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(holder.stdout.readline())
        lock = results / results_lock.LOCK_FILE
        before = (lock.read_bytes(), lock.stat().st_mtime_ns)
        with pytest.raises(results_lock.ResultsLockedError) as refused:
            results_lock.acquire(results)
        message = str(refused.value)
        assert "\n" not in message
        for part in (f"results tree {results} is in use", f"pid {holder.pid}", f"working directory {holder_dir}",
                     f"lock file {lock}"):
            assert part in message, (part, message)
        assert (lock.read_bytes(), lock.stat().st_mtime_ns) == before, "a refused run must not touch the lock file"

        holder.send_signal(signal.SIGKILL)  # the kernel drops the flock with the process...
        holder.wait()
        os.kill(child, 0)  # ...although a child it started (a job) still runs: the descriptor was not inherited
        assert results_lock.acquire(results) == lock
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert results_lock.acquire(results) == lock  # idempotent within one process
    finally:
        results_lock.release(results)
        holder.kill()
        holder.wait()
        if child:
            os.kill(child, signal.SIGKILL)
    results_lock.acquire(results)  # released: free again
    results_lock.release(results)


def test_a_second_run_on_the_same_results_tree_fails_at_once_and_touches_nothing(tmp_path):
    """Two working directories whose configs share one `results:` path: the second run stops before any job."""
    results = tmp_path / "shared" / "results"
    first, second = tmp_path / "first", tmp_path / "second"
    for workdir in (first, second):
        workdir.mkdir()
        write_config(workdir, {"results": str(results)})
    target = str(results / "target")
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(first), "--configfile",
           str(first / "config.yaml"), "--cores", "2", target]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        lock = results / results_lock.LOCK_FILE
        deadline = time.time() + 300
        # the first run holds the lock and has started its longer job (pretraining the target)
        while not ((first / "logs" / "build_target.log").exists() and lock.exists()
                   and json.loads(lock.read_text() or "{}").get("pid") == proc.pid):
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
            assert time.time() < deadline, "the first run did not start build_target"
            time.sleep(0.2)

        dry = snakemake(second, "-n", target)  # a dry run does not take the lock
        assert "build_target" in dry.stdout + dry.stderr

        started = time.time()
        refused = snakemake(second, target, check=False)
        output = refused.stdout + refused.stderr
        assert refused.returncode != 0
        assert proc.poll() is None, "the first run must still have been running"
        line = next(line for line in output.splitlines() if "is in use by another run" in line)
        for part in (f"results tree {results}", f"pid {proc.pid}", f"working directory {first}", f"lock file {lock}"):
            assert part in line, (part, line)
        assert "localrule" not in output and not (second / "logs").exists(), "no job of the second run may start"
        assert time.time() - started < 120
        assert json.loads(lock.read_text())["pid"] == proc.pid
        assert proc.wait(timeout=900) == 0, (tmp_path / "first.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (results / "target" / "config.json").exists()
