import subprocess
import sys
import time

from draftsmith.devices import claim_gpus, visible_devices

HOLD = """
import sys, time
from draftsmith.devices import claim_gpus
with claim_gpus(int(sys.argv[1]), poll_s=0.05) as ids:
    print(",".join(ids), flush=True)
    time.sleep(float(sys.argv[2]))
"""


def run_holder(n, seconds, env):
    return subprocess.Popen([sys.executable, "-c", HOLD, str(n), str(seconds)], stdout=subprocess.PIPE, text=True, env=env)


def test_jobs_get_distinct_gpus_and_the_extra_one_waits(tmp_path, monkeypatch):
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5", "DRAFTSMITH_GPU_LOCK_DIR": str(tmp_path)}
    first, second = run_holder(1, 1.5, env), run_holder(1, 1.5, env)
    time.sleep(0.3)
    start = time.time()
    third = run_holder(1, 0, env)
    got = sorted([first.stdout.readline().strip(), second.stdout.readline().strip()])
    assert got == ["3", "5"]
    assert third.stdout.readline().strip() in {"3", "5"}
    assert time.time() - start > 0.8, "the third job waited for a GPU to be released"
    for p in (first, second, third):
        assert p.wait(timeout=30) == 0


def test_no_gpu_requested_or_visible_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_GPU_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_devices() == []
    with claim_gpus(1) as ids:
        assert ids == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with claim_gpus(0) as ids:
        assert ids == []
    with claim_gpus(2) as ids:
        import os

        assert ids == ["0", "1"] and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
