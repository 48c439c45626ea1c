"""metrics.csv: speculators' metric records (per step and per validation) as CSV rows, each validation row with the
acceptance length its full accuracies predict; and the last validation read back."""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path

from tqdm import tqdm

from draftsmith.io import atomic_path
from draftsmith.training.acceptance import PREDICTED, full_accuracies, predicted_acceptance_length

log = logging.getLogger(__name__)


class MetricsCSV(logging.Handler):
    """Receives speculators' metric records; appends rows to a CSV and advances a progress bar. Each validation row
    also gets the chain acceptance length its full accuracies predict (draftsmith.training.acceptance), which the log
    line of that validation says too."""

    def __init__(self, path: Path, variant: str, ttt_steps: int, bar: tqdm | None):
        super().__init__()
        self.path, self.variant, self.bar = path, variant, bar
        self.started, self.first_step_seen = time.monotonic(), False
        keys = [f"{kind}_{i}" for kind in ("loss", "full_acc", "cond_acc") for i in range(ttt_steps)]
        # wall: the Unix time the record arrived, so step times and pauses (validation, checkpoints) show in the CSV
        self.columns = ["variant", "split", "epoch", "step", "lr", "loss"] + keys + [PREDICTED, "wall"]
        if not self.path.exists():
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self.columns)
        else:
            upgrade_metrics_header(self.path, self.columns)

    def emit(self, record: logging.LogRecord):
        msg, step = record.msg, getattr(record, "step", None)
        if not isinstance(msg, dict):
            return
        if "train" in msg:
            row = {"split": "train", "lr": msg.get("lr"), **msg["train"]}
            if not self.first_step_seen:  # compiling and the first batch's loading: on a GPU, minutes
                self.first_step_seen = True
                log.info("first optimizer step done %.1f s after training started", time.monotonic() - self.started)
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(epoch=msg["epoch"], loss=f"{msg['train'].get('loss', float('nan')):.3f}")
        elif "val" in msg:
            row = {"split": "val", **{k.removesuffix("_epoch"): v for k, v in msg["val"].items()}}
            accs = full_accuracies(row)
            row[PREDICTED] = predicted = predicted_acceptance_length(accs)
            said = ("no full accuracies to predict acceptance from" if predicted is None else
                    f"predicted acceptance length {predicted:.3f} tokens per drafted round (1 + full accuracies "
                    + " + ".join(f"{a:.3f}" for a in accs) + ")")
            log.info("epoch %d validation: %s; %s", msg["epoch"], said,
                     ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k not in ("split", PREDICTED)))
        else:
            return
        row.update(variant=self.variant, epoch=msg["epoch"], step=step, wall=f"{time.time():.3f}")
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in self.columns])


def upgrade_metrics_header(path: Path, columns: list[str]) -> None:
    """A metrics.csv an older draftsmith wrote (a resumed run) rewritten with today's columns: its rows keep their
    values by column name, and its validation rows get the predicted acceptance length."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        if reader.fieldnames == columns:
            return
    for row in rows:
        if row.get("split") == "val" and not row.get(PREDICTED):
            predicted = predicted_acceptance_length(full_accuracies(row))
            row[PREDICTED] = "" if predicted is None else repr(predicted)
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore", restval="")
        writer.writeheader()
        writer.writerows(rows)


def final_validation(metrics_path: Path) -> dict | None:
    """The last validation row of a metrics.csv: epoch, step, loss, full and conditional accuracy per TTT step, and
    the acceptance length they predict; None where training held no samples out."""
    with open(metrics_path, newline="") as f:
        val = [r for r in csv.DictReader(f) if r["split"] == "val"]
    if not val:
        return None
    last = val[-1]
    steps = len(full_accuracies(last))
    accs = [float(last[f"full_acc_{i}"]) for i in range(steps)]
    return {"epoch": int(last["epoch"]), "step": int(last["step"]) if last["step"] else None,
            "loss": float(last["loss"]), "full_acc": accs,
            "cond_acc": [float(last[f"cond_acc_{i}"]) for i in range(steps)],
            PREDICTED: predicted_acceptance_length(accs)}
