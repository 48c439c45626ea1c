"""Console progress: one line per running job every DRAFTSMITH_PROGRESS_S seconds (30 by default) with its progress and
ETA, or how long it has run, and the log to follow; the tqdm bars themselves stay in the rule's log."""

from __future__ import annotations

import io
import os
import re
import subprocess

from conftest import REPO, SNAKEMAKE, write_config
from tqdm import tqdm

from draftsmith.progress import ProgressReporter, console_progress


def test_the_line_gives_each_live_bar_with_its_rate_and_eta_on_a_fake_clock():
    steps = tqdm(total=400, desc="train draft", unit="step", file=io.StringIO())
    tokens = tqdm(total=2_000_000, initial=500_000, desc="shard 0", unit="tok", unit_scale=True, file=io.StringIO())
    now = [steps.start_t]
    reporter = ProgressReporter("train_draft", {"variant": "default"}, "results/logs/train_draft/default.log",
                                clock=lambda: now[0], bars=[steps, tokens])
    steps.update(100)
    tokens.update(300_000)
    now[0] = steps.start_t + 60
    assert reporter.line() == (
        "[progress] train_draft variant=default: train draft 100/400 step (25%), 1.67 step/s, ETA 03:00; "
        f"shard 0 800k/2.00M tok (40%), {tqdm.format_sizeof(300_000 / (now[0] - tokens.start_t))} tok/s, ETA "
        f"{tqdm.format_interval(1_200_000 / (300_000 / (now[0] - tokens.start_t)))} "
        "(log: results/logs/train_draft/default.log)")
    steps.close()
    tokens.close()
    reporter.bars = None  # the live bars: none now
    assert reporter.line() == ("[progress] train_draft variant=default: running for 01:00 "
                               "(log: results/logs/train_draft/default.log)")


def test_a_line_every_interval_and_none_after_the_job():
    import time

    console = io.StringIO()
    # the bar stays open until the block has ended: closed inside it, a tick between the close and the block's end
    # (the 2-core CI machine under load) reports the job with no live bar, "running for", which this test is not about
    bar = tqdm(total=10, desc="count", file=io.StringIO())
    try:
        with console_progress("vocab_map", {}, None, stream=console, interval=0.05):
            bar.update(5)
            time.sleep(0.3)
        lines = console.getvalue().splitlines()
        assert 3 <= len(lines) <= 7 and all(line.startswith("[progress] vocab_map: count 5/10 it (50%)") for line in lines)
        time.sleep(0.2)
        assert console.getvalue().splitlines() == lines
    finally:
        bar.close()


def test_a_real_stage_reports_its_bar_on_the_console_and_keeps_the_bar_in_its_log(tmp_path):
    """build_target's pretraining bar (tqdm into the rule's log): one console line a second here (30 s by default),
    with n/total and the log path (the rate and ETA once the bar has refreshed: the fake-clock test above); the bar
    itself is not on the console."""
    write_config(tmp_path, {"embedded_target": {"pretrain_steps": 20}})
    target = "results/target"  # a tree under the working directory is named relative to it
    env = {**os.environ, "DRAFTSMITH_PROGRESS_S": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), "--configfile",
                           str(tmp_path / "config.yaml"), "--cores", "2", str(target)], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = tmp_path / "results" / "logs" / "build_target.log"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[progress] build_target")]
    assert lines and all(line.endswith("(log: results/logs/build_target.log)") for line in lines)
    assert any(re.search(r"build_target: pretrain target \d+/20 it \(\d+%\)", line) for line in lines), lines
    assert "pretrain target" in log.read_text() and "it/s]" not in proc.stderr  # tqdm's own bar: in the log only
