"""One console line per running job every DRAFTSMITH_PROGRESS_S seconds (30 by default): its rule and wildcards, the
progress of its tqdm bars (n/total, rate, ETA) or how long it has run, and the log to follow.

A job's tqdm bars write to its log (draftsmith.smk.setup_logging sends stderr there): on the console, several jobs'
bars would flood it, and without them a user saw nothing for the 14 minutes of build_target. The reporter reads the
live bars (tqdm keeps them in tqdm._instances, whichever code made them), so no stage has to know about it."""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

from tqdm import tqdm

INTERVAL_ENV = "DRAFTSMITH_PROGRESS_S"
DEFAULT_INTERVAL_S = 30.0


def describe(bar: tqdm, now: float) -> str:
    """`desc n/total unit (p%), rate unit/s, ETA m:ss` of a live bar, as of its last refresh; the rate is the
    average since the bar started (at `now`, on the bar's clock)."""
    d = bar.format_dict
    n, total, unit = d["n"], d["total"], d["unit"]
    elapsed = now - bar.start_t
    rate = (n - d["initial"]) / elapsed if elapsed > 0 else None

    def count(x):
        return tqdm.format_sizeof(x) if d["unit_scale"] else f"{x:.3g}" if x != int(x) else str(int(x))

    text = f"{d['prefix'] or 'progress'} {count(n)}"
    if total:
        text += f"/{count(total)} {unit} ({100 * n / total:.0f}%)"
    else:
        text += f" {unit}"
    if rate:
        text += f", {count(round(rate, 2) if rate < 100 else round(rate))} {unit}/s"
        if total and n < total:
            text += f", ETA {tqdm.format_interval((total - n) / rate)}"
    return text


class ProgressReporter:
    """The console line of one job; `clock` and `bars` are injectable for tests (a fake clock, chosen bars)."""

    def __init__(self, rule: str, wildcards: dict, log_path: str | None, clock=time.time, bars=None):
        self.label = rule + "".join(f" {k}={v}" for k, v in wildcards.items())
        self.log_path, self.clock, self.bars = log_path, clock, bars
        self.started = clock()

    def line(self) -> str:
        now = self.clock()
        bars = self.bars if self.bars is not None else [b for b in list(tqdm._instances) if not b.disable]
        parts = [describe(b, now) for b in bars] or [f"running for {tqdm.format_interval(now - self.started)}"]
        log = f" (log: {self.log_path})" if self.log_path else ""
        return f"[progress] {self.label}: {'; '.join(parts)}{log}"


@contextmanager
def console_progress(rule: str, wildcards: dict, log_path: str | None, stream=None, interval: float | None = None):
    """Write ProgressReporter's line to `stream` (the console's stderr) every `interval` seconds while the block runs."""
    interval = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)) if interval is None else interval
    stream = stream or sys.__stderr__
    reporter, stop = ProgressReporter(rule, wildcards, log_path), threading.Event()

    def report():
        while not stop.wait(interval):
            try:
                print(reporter.line(), file=stream, flush=True)
            except Exception:  # noqa: BLE001 - progress must never fail the job it reports on
                pass

    thread = threading.Thread(target=report, name="draftsmith-progress", daemon=True)
    thread.start()
    try:
        yield reporter
    finally:
        stop.set()
        thread.join(timeout=5)
