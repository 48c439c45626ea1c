"""The training state directory: speculators' checkpoints, the metrics CSV and a fingerprint of the inputs.

`state_dir/checkpoints/<epoch>/` holds what speculators' Trainer saves each epoch, `metrics.csv` what
`trainer.MetricsCSV` logs, `fingerprint.json` everything that determines the trained weights. A run
resumes only when the fingerprint is unchanged; the last epoch's checkpoint is the variant's draft.
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

from draftsmith.extraction.shards import read_manifest
from draftsmith.io import atomic_path, read_json, sha256_bytes, sha256_file, write_json
from draftsmith.provenance import changed_keys, package_versions
from draftsmith.target_model.spec import TargetSpec

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
METRICS = "metrics.csv"
FINGERPRINT = "fingerprint.json"


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


def training_fingerprint(manifests: list[str], d2t: str, t2d: str, target: TargetSpec, training: dict, gpus: int) -> dict:
    """Everything that determines the trained weights, as it reads back from JSON.

    Shards count by their sample list (each file's sha256 and length), not by the whole manifest,
    whose timing fields change when a shard is extracted again to the same bytes. `resume` only
    says whether to resume; the GPU count sets the world size and so the data order.
    """
    shards = []
    for path in manifests:
        m = read_manifest(path)
        shards.append({"aux_layer_ids": m["aux_layer_ids"],
                       "samples_list_sha256": sha256_bytes(json.dumps(m["samples"], sort_keys=True).encode())})
    fingerprint = {
        "shards": shards,
        "d2t": sha256_file(d2t),
        "t2d": sha256_file(t2d),
        "target": target.fingerprint(),
        "training": {k: v for k, v in training.items() if k != "resume"},
        "versions": package_versions(("speculators", "draftsmith")),
        "gpus": gpus,
    }
    return json.loads(json.dumps(fingerprint, sort_keys=True, default=str))


def prepare_state(state_dir: Path, fingerprint: dict, resume: bool) -> None:
    """Keep the checkpoints only to resume on the same inputs; record the inputs before training.

    Old checkpoints and metrics are removed before the new fingerprint is written, so a job
    killed in between never leaves new inputs paired with old checkpoints.
    """
    path = state_dir / FINGERPRINT
    old = read_json(path, rebuild=f"delete {state_dir} to train afresh") if path.exists() else None
    if resume and old == fingerprint:
        return
    if resume and old is not None:
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
