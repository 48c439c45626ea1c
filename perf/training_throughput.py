"""Training throughput: draftsmith's train_draft vs speculators 0.3.0's own recipe, same shards.

The baseline is the composition speculators 0.3.0's `scripts/train.py` builds (its dataset with
file-size length estimates, multipack sampler, 12 loader workers with pinned memory, uniform
noise, `Trainer` on `local_rank` 0), driven through speculators' public API in this process.
Both run one epoch over the same shards with the same sequence budget, TTT steps and lr, after a
shared warm-up so neither pays torch.compile alone. GPU only: speculators 0.3.0 cannot train on CPU.

    python perf/training_throughput.py --results results-gpu --epochs 1 --table perf/results/training.md
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.extraction.shards import shard_files  # noqa: E402
from draftsmith.io import read_json, write_text  # noqa: E402
from draftsmith.provenance import package_versions  # noqa: E402
from draftsmith.target_model.spec import TargetSpec  # noqa: E402
from draftsmith.training.trainer import run_training, split_train_val  # noqa: E402


class StepTimer(logging.Handler):
    """Timestamps each training step from speculators' metric records (both runs emit them)."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.times.append(time.perf_counter())

    def steady_steps_per_s(self, skip: int = 3) -> float:
        """Steps per second from the median step interval after `skip` steps: in-epoch speed, without the
        pauses between epochs (validation, checkpointing), which the wall figures include."""
        return 1.0 / float(np.median(np.diff(self.times[skip:])))

    def pauses_s(self, skip: int = 3) -> float:
        """Seconds beyond the median step interval, summed: validation, checkpoints, recompiles."""
        gaps = np.diff(self.times[skip:])
        return float(np.sum(gaps - np.median(gaps)))


def timed(fn, *args):
    timer = StepTimer()
    logger = logging.getLogger("speculators.metrics")
    logger.setLevel(logging.INFO)
    logger.addHandler(timer)
    start = time.perf_counter()
    try:
        fn(*args)
        torch.cuda.synchronize()
    finally:
        logger.removeHandler(timer)
    return time.perf_counter() - start, timer


def upstream_recipe(files, val_files, d2t_path, t2d_path, target, cfg, save_path):
    """speculators 0.3.0 scripts/train.py's setup, expressed with its public classes."""
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.noise_transforms import AddUniformNoise
    from speculators.train.trainer import Trainer, TrainerConfig
    from torch.utils.data import DataLoader

    from draftsmith.training.draft_model import build_draft

    device = torch.device(0)
    d2t = torch.from_numpy(np.load(d2t_path)).to(device)
    t2d = torch.from_numpy(np.load(t2d_path)).to(device)
    aux = read_json(Path(files[0]).parent / "manifest.json")["aux_layer_ids"]
    model = build_draft(target, d2t, t2d, cfg["draft_layers"], aux, cfg["ttt_steps"], cfg["seed"])

    def loader(file_list, noise):
        transform = AddUniformNoise(std=0.05, tensors=("hidden_states", "verifier_last_hidden_states")) if noise else None
        dataset = Eagle3SampleFileDataset(file_list=file_list, max_len=cfg["total_seq_length"], transform=transform)
        sampler = MultipackDistributedBatchSamplerV2(batch_max_length=cfg["total_seq_length"],
                                                     lengths=dataset.approx_lengths, num_replicas=1, rank=0)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=12, prefetch_factor=4, pin_memory=True,
                          collate_fn=create_collate_fn(cfg["total_seq_length"]), persistent_workers=True)

    kwargs = {"use_off_policy_tokens": False, "ttt_steps": cfg["ttt_steps"], "ttt_step_loss_decay": cfg["ttt_step_loss_decay"]}
    config = TrainerConfig(num_epochs=cfg["epochs"], save_path=str(save_path), lr=cfg["lr"], resume_from_checkpoint=False,
                           is_distributed=False, local_rank=0, train_call_kwargs=kwargs, val_call_kwargs=kwargs)
    Trainer(model, config, loader(files, True), loader(val_files, False)).run_training()


def warm_up(files, d2t_path, t2d_path, target, cfg):
    """Compile the draft's forward/backward once so both measured runs find it compiled."""
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn

    from draftsmith.training.draft_model import build_draft

    device = torch.device(0)
    aux = read_json(Path(files[0]).parent / "manifest.json")["aux_layer_ids"]
    model = build_draft(target, torch.from_numpy(np.load(d2t_path)).to(device), torch.from_numpy(np.load(t2d_path)).to(device),
                        cfg["draft_layers"], aux, cfg["ttt_steps"]).to(device)
    dataset = Eagle3SampleFileDataset(file_list=files[:64], max_len=cfg["total_seq_length"])
    batch = create_collate_fn(cfg["total_seq_length"])([dataset[i] for i in range(min(8, len(dataset)))])
    batch = {k: v.to(device) for k, v in batch.items()}
    start = time.perf_counter()
    for _ in range(2):
        _, loss, _ = model(**batch, ttt_steps=cfg["ttt_steps"])
        loss.backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True, help="a results tree with shards/, vocab/ and target/ (the GPU config's)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--min-steps", type=int, default=0, help="raise --epochs until each run takes at least this many steps")
    ap.add_argument("--total-seq-length", type=int, default=8192)
    ap.add_argument("--table", default="perf/results/training.md")
    args = ap.parse_args()
    results = Path(args.results)
    target = TargetSpec(args.target or str(results / "target"))
    manifests = sorted(str(p) for p in results.glob("shards/*/shard_*/manifest.json"))
    d2t, t2d = str(results / "vocab" / "d2t.npy"), str(results / "vocab" / "t2d.npy")
    cfg = {"draft_layers": 1, "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "lr": 1e-4, "epochs": args.epochs,
           "total_seq_length": args.total_seq_length, "scheduler": "linear", "warmup_steps": None, "noise_std": 0.05,
           "val_fraction": 0.1, "data_fraction": 1.0, "seed": 0, "resume": False, "gpus": 1}
    if not manifests or not Path(d2t).is_file():
        sys.exit(f"{results}: no shards or vocab map; build them first, e.g. `snakemake --cores all --configfile "
                 "config/gpu.yaml` (perf/gpu_suite.sh pipeline) or pass --results of a finished run")
    files = shard_files(manifests)
    lengths = [e["num_tokens"] for m in manifests for e in read_json(m)["samples"]]
    (train_files, train_lengths), (val_files, _) = split_train_val(files, lengths, 0.1, 0)
    train_tokens = sum(train_lengths)
    if args.min_steps:
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

        per_epoch = len(MultipackDistributedBatchSamplerV2(batch_max_length=args.total_seq_length,
                                                           lengths=[n - 1 for n in train_lengths], num_replicas=1, rank=0))
        args.epochs = max(args.epochs, -(-args.min_steps // per_epoch))
        cfg["epochs"] = args.epochs
        print(f"{per_epoch} steps per epoch: {args.epochs} epochs for >= {args.min_steps} steps", flush=True)

    compile_s = warm_up(train_files, d2t, t2d, target, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t_upstream, up = timed(upstream_recipe, train_files, val_files, d2t, t2d, target, cfg, Path(tmp) / "upstream")
        ours_args = {"manifests": manifests, "d2t": d2t, "t2d": t2d, "target": target.to_dict(), "training": cfg,
                     "state_dir": str(Path(tmp) / "ours"), "variant": "bench", "gpus": 1, "num_workers": 8}
        t_ours, us = timed(run_training, ours_args)

    device = torch.cuda.get_device_name(0)
    tokens = train_tokens * args.epochs
    lines = [
        f"Draft training throughput, {len(manifests)} shards, {len(train_files)} training samples ({train_tokens} tokens), "
        f"{args.epochs} epoch(s) each with validation and checkpointing, total_seq_length {args.total_seq_length}, 3 TTT steps, "
        f"on {device}; {time.strftime('%Y-%m-%d')}; torch {package_versions().get('torch')}, speculators "
        f"{package_versions().get('speculators')}. Shared warm-up (torch.compile) took {compile_s:.1f} s, excluded.",
        "",
        "| run | wall s | tokens/s (wall) | steps | pauses s | steady tokens/s (median step) | ratio (steady) | ratio (wall) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    steady = {}
    for name, secs, timer in (("speculators 0.3.0 recipe (scripts/train.py setup)", t_upstream, up),
                              ("draftsmith train_draft", t_ours, us)):
        steady[name] = tokens / len(timer.times) * timer.steady_steps_per_s()
    base = steady["speculators 0.3.0 recipe (scripts/train.py setup)"]
    for name, secs, timer in (("speculators 0.3.0 recipe (scripts/train.py setup)", t_upstream, up),
                              ("draftsmith train_draft", t_ours, us)):
        lines.append(f"| {name} | {secs:.1f} | {tokens / secs:,.0f} | {len(timer.times)} | {timer.pauses_s():.1f} | "
                     f"{steady[name]:,.0f} | {steady[name] / base:.2f} | {t_upstream / secs:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    write_text(args.table, table)
    write_text(Path(args.table).with_suffix(".json"), json.dumps(
        {"upstream_s": t_upstream, "ours_s": t_ours, "tokens": tokens, "steady_tps": steady, "device": device,
         "compile_s": compile_s}, indent=2) + "\n")


if __name__ == "__main__":
    main()
