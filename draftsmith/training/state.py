"""The training state directory: speculators' checkpoints, the metrics CSV and a fingerprint of the inputs.

`state_dir/checkpoints/<epoch>/` holds what speculators' Trainer saves each epoch, `metrics.csv` what
`metrics.MetricsCSV` logs, `fingerprint.json` everything that determines the trained weights. A run
resumes only when the fingerprint is unchanged and the last checkpoint holds draftsmith's exact resume state
(`checkpoints/<epoch>/resume/`: full-precision weights, RNG states, step counter, learning rates; the
optimizer state beside it is full precision too); the last epoch's checkpoint is the variant's draft.
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

from draftsmith.io import atomic_path, read_json, sha256_file, write_json
from draftsmith.provenance import changed_keys, package_versions
from draftsmith.target_model.spec import TargetSpec

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
METRICS = "metrics.csv"
FINGERPRINT = "fingerprint.json"
# checkpoints/<epoch>/resume/: what draftsmith adds to speculators' checkpoint so that a resumed run repeats the
# uninterrupted one bit for bit. RESUME_MARKER is written last; RESUME_FORMAT changes whenever the contents do.
RESUME_DIR = "resume"
RESUME_MARKER = "resume.json"
RESUME_WEIGHTS = "model.safetensors"
RESUME_FORMAT = 1


def resume_rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def last_checkpoint(checkpoints: Path) -> Path | None:
    """The checkpoint speculators' Trainer resumes from: the highest epoch-numbered directory."""
    epochs = [int(d.name) for d in checkpoints.iterdir() if d.is_dir() and d.name.isdigit()] if checkpoints.is_dir() else []
    return checkpoints / str(max(epochs)) if epochs else None


def inexact_resume_reason(checkpoints: Path, device_type: str | None) -> str | None:
    """Why resuming from the last checkpoint would not repeat an uninterrupted run (None: it would, or there is none)."""
    last = last_checkpoint(checkpoints)
    if last is None:
        return None
    marker = last / RESUME_DIR / RESUME_MARKER
    if not marker.exists():
        return (f"the checkpoint of epoch {last.name} has no exact resume state (an older draftsmith wrote it: bfloat16 "
                "weights and optimizer state, no RNG state), so resuming would not reproduce an uninterrupted run")
    info = read_json(marker)
    if info.get("format") != RESUME_FORMAT:
        return (f"the checkpoint of epoch {last.name} holds resume state format {info.get('format')}, "
                f"this draftsmith reads format {RESUME_FORMAT}")
    if device_type is not None and info.get("device_type") != device_type:
        return (f"the checkpoint of epoch {last.name} was written training on {info.get('device_type')}, this run trains "
                f"on {device_type}: the remaining epochs would not reproduce an uninterrupted run")
    missing = [name for name in [RESUME_WEIGHTS] + [resume_rank_file(r) for r in range(info.get("world_size", 1))]
               if not (last / RESUME_DIR / name).exists()]
    if missing:
        return f"the checkpoint of epoch {last.name} lacks {', '.join(f'{RESUME_DIR}/{m}' for m in missing)}"
    return None


def drop_metrics_from(path: Path, first_epoch: int) -> None:
    """Forget metric rows of epochs that will be re-run (a job killed mid-epoch)."""
    if not path.exists():
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    epoch_col = rows[0].index("epoch")
    kept = [rows[0]] + [r for r in rows[1:] if int(r[epoch_col]) < first_epoch]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        csv.writer(f).writerows(kept)


def training_fingerprint(states, d2t: str, t2d: str, target: TargetSpec, training: dict, gpus: int) -> dict:
    """Everything that determines the trained weights, as it reads back from JSON.

    `states`: the hidden-state source (draftsmith.training.sources; a list of shard manifests is the offline one),
    which fingerprints its own inputs. `resume` only says whether to resume; the GPU count sets the world size and so
    the data order.
    """
    from draftsmith.training.sources import states_source

    source = states_source(states)
    fingerprint = {
        **source.fingerprint(),
        "d2t": sha256_file(d2t),
        "t2d": sha256_file(t2d),
        "target": target.fingerprint(),
        "training": {k: v for k, v in training.items() if k != "resume"},
        "versions": package_versions(("speculators", "draftsmith")),
        "gpus": gpus,
    }
    return json.loads(json.dumps(fingerprint, sort_keys=True, default=str))


def prepare_state(state_dir: Path, fingerprint: dict, resume: bool, device_type: str | None = None) -> None:
    """Keep the checkpoints only to resume on the same inputs, exactly; record the inputs before training.

    A checkpoint that cannot be resumed exactly (written by an older draftsmith, or on another device type
    than `device_type`, the one this run trains on) is not resumed: training starts afresh, saying why.
    Old checkpoints and metrics are removed before the new fingerprint is written, so a job
    killed in between never leaves new inputs paired with old checkpoints.
    """
    path = state_dir / FINGERPRINT
    old = read_json(path, rebuild=f"delete {state_dir} to train afresh") if path.exists() else None
    if resume and old == fingerprint:
        reason = inexact_resume_reason(state_dir / CHECKPOINTS, device_type)
        if reason is None:
            return
        log.info("%s: starting afresh", reason)
    elif resume and old is not None:
        log.info("training inputs changed (%s): starting afresh", ", ".join(changed_keys(old, fingerprint)))
    elif resume and (state_dir / CHECKPOINTS).exists():
        log.info("%s has no fingerprint of its training inputs (an older draftsmith wrote it): starting afresh", state_dir)
    shutil.rmtree(state_dir / CHECKPOINTS, ignore_errors=True)
    (state_dir / METRICS).unlink(missing_ok=True)
    write_json(path, fingerprint)


def export_checkpoint(state_dir: Path, epochs: int, out_config: Path, out_weights: Path, out_metrics: Path) -> None:
    last = Path(state_dir) / CHECKPOINTS / str(epochs - 1)
    if not (last / "model.safetensors").exists():
        raise RuntimeError(f"training finished without a checkpoint for epoch {epochs - 1} in {last}")
    for src, dst in ((last / "config.json", out_config), (last / "model.safetensors", out_weights),
                     (Path(state_dir) / METRICS, out_metrics)):
        with atomic_path(dst) as tmp:
            shutil.copyfile(src, tmp)
