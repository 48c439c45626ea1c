"""Glue for `script:` entry points: logging to the rule's log file, threads, clear failures."""

from __future__ import annotations

import logging
import os
import sys
import traceback


def setup_logging(log_path: str | None) -> None:
    """Send logging, warnings and stderr (tqdm's progress bars) to the rule's log file."""
    handlers: list[logging.Handler] = []
    if log_path:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        stream = open(log_path, "a", buffering=1)
        sys.stderr = stream
        handlers.append(logging.StreamHandler(stream))
    else:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    logging.captureWarnings(True)


def to_console(lines: list[str]) -> None:
    """Print a verdict on the console as well as in the log: setup_logging sends stderr to the log file, and
    Snakemake shows a script job's standard output."""
    print("\n".join(lines), file=sys.__stdout__, flush=True)


def run(main, snakemake) -> None:
    """Run `main(snakemake)` with logging set up; log the traceback of any failure, then re-raise."""
    setup_logging(snakemake.log[0] if len(snakemake.log) else None)
    threads = int(getattr(snakemake, "threads", 1) or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:
        pass
    log = logging.getLogger(f"draftsmith.rule.{snakemake.rule}")
    log.info("rule %s started (threads=%d)", snakemake.rule, threads)
    results = (getattr(snakemake, "config", None) or {}).get("results")
    if results:
        from draftsmith.compiling import use_results_cache

        use_results_cache(results)
    from draftsmith.devices import claim_gpus

    from draftsmith.progress import console_progress

    wildcards = dict(snakemake.wildcards.items()) if hasattr(snakemake.wildcards, "items") else {}
    log_path = snakemake.log[0] if len(snakemake.log) else None
    try:
        with claim_gpus(int(getattr(snakemake.resources, "gpu", 0) or 0)):
            with console_progress(snakemake.rule, wildcards, log_path):
                main(snakemake)
    except Exception:
        log.error("rule %s failed:\n%s", snakemake.rule, traceback.format_exc())
        raise
    if results:
        from draftsmith.provenance import record_job

        record_job(snakemake.rule, snakemake.input, snakemake.output, results)
    log.info("rule %s finished", snakemake.rule)
