"""What regenerate wrote, as the steps after it read it: the stats beside its output, kept only while they describe
the output as it is (its sha256). self_prompts keeps its stats the same way."""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.io import read_json, sha256_file

log = logging.getLogger(__name__)


def regenerate_stats_path(out_jsonl: str | Path) -> Path:
    """Where regenerate writes its stats: `<name>.stats.json` beside `<name>.jsonl`."""
    out_jsonl = Path(out_jsonl)
    return out_jsonl.with_name(out_jsonl.name.removesuffix(".jsonl") + ".stats.json")


def read_regenerate_stats(jsonl_path: str | Path, writer: str = "regenerate") -> dict | None:
    """The stats regenerate (or `writer`, e.g. self_prompts, which keeps them the same way) wrote for `jsonl_path`,
    or None when there are none, or they describe another version of the file (sha256 differs: logged)."""
    path = regenerate_stats_path(jsonl_path)
    if not path.is_file():
        return None
    try:
        stats = read_json(path)
    except ValueError as e:  # written atomically, so only a hand-edited file gets here
        log.warning("%s is not readable (%s); %s's counts are left out of the stats", path, e, writer)
        return None
    if not isinstance(stats, dict) or stats.get("output_sha256") != sha256_file(jsonl_path):
        log.warning("%s does not describe %s as it is now (sha256 differs); %s's counts are left out of "
                    "the stats", path, jsonl_path, writer)
        return None
    return stats
