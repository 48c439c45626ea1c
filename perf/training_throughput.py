"""Training throughput: draftsmith's train_draft vs speculators 0.3.0's own recipe, same shards.

The baseline is the composition speculators 0.3.0's `scripts/train.py` builds (its dataset with
file-size length estimates, multipack sampler, 12 loader workers with pinned memory, uniform
noise, `Trainer` on `local_rank` 0), driven through speculators' public API in this process.
Both run one epoch over the same shards with the same sequence budget, TTT steps and lr, after a
shared warm-up so neither pays torch.compile alone. GPU only: speculators 0.3.0 cannot train on CPU.

    python -m perf training_throughput --results results-gpu --epochs 1

--repeats n alternates the two runs n times (recipe, ours, recipe, ours, ...) to show the run-to-run spread;
--profile FILE profiles a few steady steps of a separate one-epoch draftsmith run (torch.profiler: the ops that
take the time, and how busy the device was over those steps).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from draftsmith.extraction.shards import shard_files
from draftsmith.io import read_json, write_text
from draftsmith.provenance import package_versions
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.loader import split_train_val
from draftsmith.training.trainer import matmul_precision, run_training
from perf.common import commit, parser, write_table


class StepTimer(logging.Handler):
    """Timestamps each training step from speculators' metric records (both runs emit them); `on_step`, if
    given, is called after each step (a profiler's step())."""

    def __init__(self, on_step=None):
        super().__init__()
        self.times: list[float] = []
        self.on_step = on_step

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.times.append(time.perf_counter())
            if self.on_step is not None:
                self.on_step()

    def steady_steps_per_s(self, skip: int = 3) -> float:
        """Steps per second from the median step interval after `skip` steps: in-epoch speed, without the
        pauses between epochs (validation, checkpointing), which the wall figures include."""
        return 1.0 / float(np.median(np.diff(self.times[skip:])))

    def pauses_s(self, skip: int = 3) -> float:
        """Seconds beyond the median step interval, summed: validation, checkpoints, recompiles."""
        gaps = np.diff(self.times[skip:])
        return float(np.sum(gaps - np.median(gaps)))


def timed(fn, *args, on_step=None):
    timer = StepTimer(on_step)
    logger = logging.getLogger("speculators.metrics")
    logger.setLevel(logging.INFO)
    logger.addHandler(timer)
    start = time.perf_counter()
    try:
        fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        logger.removeHandler(timer)
    return time.perf_counter() - start, timer


def profile_steps(fn, args, path, wait: int = 10, active: int = 5) -> dict:
    """Run `fn(args)` under torch.profiler, recording `active` training steps after `wait` + 1 warm-up steps; write
    the ops that took the time to `path`. Returns the recorded steps' wall seconds and the device's busy seconds in
    them (the sum of its kernels' times: 0 on a CPU run)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, schedule=schedule(wait=wait, warmup=1, active=active, repeat=1)) as prof:
        _, timer = timed(fn, args, on_step=prof.step)
    if len(timer.times) < wait + 1 + active:
        raise RuntimeError(f"the profiled run took {len(timer.times)} steps; the profile needs {wait + 1 + active}")
    events = prof.key_averages()
    # the recorded steps run from the end of step wait + 1 (the warm-up step) to the end of step wait + 1 + active
    steps_s = timer.times[wait + active] - timer.times[wait]
    # kernel and copy events only (as the table's "Self CUDA time total"): their launching ops and the step
    # annotations repeat the same time
    device_s = sum(e.self_device_time_total for e in events
                   if e.device_type != DeviceType.CPU and not e.is_user_annotation) / 1e6
    sort_by = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    summary = {"steps": active, "wall_s": steps_s, "device_busy_s": device_s, "device_busy_fraction": device_s / steps_s}
    write_text(path, f"{active} training steps of draftsmith's train_draft after {wait + 1}: {steps_s:.3f} s wall, "
               f"device kernels {device_s:.3f} s ({100 * summary['device_busy_fraction']:.0f}% busy)\n\n"
               + events.table(sort_by=sort_by, row_limit=30) + "\n")
    return summary


def upstream_recipe(files, val_files, d2t_path, t2d_path, target, cfg, save_path):
    """speculators 0.3.0 scripts/train.py's setup, expressed with its public classes."""
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.noise_transforms import AddUniformNoise
    from speculators.train.trainer import Trainer, TrainerConfig
    from torch.utils.data import DataLoader

    from draftsmith.draft_model import build_draft

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
    """Compile the draft's forward/backward once (at the current matmul precision) so the runs find it compiled."""
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn

    from draftsmith.draft_model import build_draft

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


def main(argv=None):
    ap = parser(__doc__, table="training")
    ap.add_argument("--results", required=True, help="a results tree with shards/, vocab/ and target/ (the GPU config's)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--min-steps", type=int, default=0, help="raise --epochs until each run takes at least this many steps")
    ap.add_argument("--total-seq-length", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=1, help="alternate the two runs this many times (run-to-run spread)")
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of draftsmith's steady steps here")
    ap.add_argument("--tf32", choices=["on", "off"], default="on",
                    help="draftsmith's training.tf32 (the recipe runs at PyTorch's default, full float32)")
    args = ap.parse_args(argv)
    results = Path(args.results)
    target = TargetSpec(args.target or str(results / "target"))
    manifests = sorted(str(p) for p in results.glob("shards/*/shard_*/manifest.json"))
    d2t, t2d = str(results / "vocab" / "d2t.npy"), str(results / "vocab" / "t2d.npy")
    cfg = {"draft_layers": 1, "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "lr": 1e-4, "epochs": args.epochs,
           "total_seq_length": args.total_seq_length, "scheduler": "linear", "warmup_steps": None, "noise_std": 0.05,
           "val_fraction": 0.1, "data_fraction": 1.0, "seed": 0, "resume": False, "gpus": 1, "tf32": args.tf32 == "on",
           "compile": "forward", "hidden_states": "offline"}  # the recipe compiles the whole forward too
    if not manifests or not Path(d2t).is_file():
        sys.exit(f"{results}: no shards or vocab map; build them first, e.g. `snakemake --cores all --configfile "
                 "config/gpu.yaml` (bash perf/gpu/pipeline.sh) or pass --results of a finished run")
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

    # torch.compile guards on the matmul precision: compile once for each run's setting
    compile_s = warm_up(train_files, d2t, t2d, target, cfg)
    if cfg["tf32"]:
        with matmul_precision(True):
            compile_s += warm_up(train_files, d2t, t2d, target, cfg)
    recipe, ours = "speculators 0.3.0 recipe (scripts/train.py setup)", "draftsmith train_draft"
    device = torch.cuda.get_device_name(0)
    tokens = train_tokens * args.epochs

    def report(runs, profile=None):
        """Print and write the table so far (after every run: a call cut short still leaves its numbers)."""
        lines = [
            f"Draft training throughput, {len(manifests)} shards, {len(train_files)} training samples ({train_tokens} "
            f"tokens), {args.epochs} epoch(s) each with validation and checkpointing, total_seq_length "
            f"{args.total_seq_length}, 3 TTT steps, on {device}; {time.strftime('%Y-%m-%d')}; commit {commit()}; torch "
            f"{package_versions().get('torch')}, speculators {package_versions().get('speculators')}. Shared warm-up "
            f"(torch.compile) took {compile_s:.1f} s, excluded. Runs alternate, {args.repeats} of each; ratios are "
            "against the recipe run of the same repeat. float32 matmuls: the recipe full float32 (PyTorch's default), "
            f"draftsmith {'TF32' if cfg['tf32'] else 'full float32'} (training.tf32).",
            "",
            "| repeat | run | wall s | tokens/s (wall) | steps | pauses s | steady tokens/s (median step) | ratio (steady) | ratio (wall) |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        steady = [tokens / len(timer.times) * timer.steady_steps_per_s() for _, _, _, timer in runs]
        ratios = {"steady": [], "wall": []}
        for i, (repeat, name, secs, timer) in enumerate(runs):
            base = i - i % 2  # the recipe run of this repeat
            steady_ratio, wall_ratio = steady[i] / steady[base], runs[base][2] / secs
            if name == ours:
                ratios["steady"].append(steady_ratio)
                ratios["wall"].append(wall_ratio)
            lines.append(f"| {repeat + 1} | {name} | {secs:.1f} | {tokens / secs:,.0f} | {len(timer.times)} | "
                         f"{timer.pauses_s():.1f} | {steady[i]:,.0f} | {steady_ratio:.3f} | {wall_ratio:.2f} |")
        if len(ratios["steady"]) > 1:
            recipe_steady = steady[0::2]
            lines += ["", f"draftsmith / recipe, steady: median {np.median(ratios['steady']):.3f} (runs "
                      + ", ".join(f"{r:.3f}" for r in ratios["steady"]) + "); the recipe's own runs spread "
                      f"{100 * (max(recipe_steady) - min(recipe_steady)) / np.median(recipe_steady):.1f}% "
                      "(max - min over median)."]
        if profile:
            lines += ["", f"Profile ({Path(args.profile).name}): {profile['steps']} steady draftsmith steps, "
                      f"{profile['wall_s']:.3f} s wall, device kernels {profile['device_busy_s']:.3f} s "
                      f"({100 * profile['device_busy_fraction']:.0f}% busy)."]
        table = "\n".join(lines) + "\n"
        write_table(args.table, table,
            {"runs": [{"repeat": r + 1, "run": name, "wall_s": secs, "steps": len(t.times), "steady_tps": tps}
                      for (r, name, secs, t), tps in zip(runs, steady)],
             "ratios": ratios, "tokens": tokens, "device": device, "compile_s": compile_s, "tf32": cfg["tf32"],
             "profile": profile, "commit": commit()})

    runs = []  # (repeat, name, wall seconds, StepTimer)
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            secs, timer = timed(upstream_recipe, train_files, val_files, d2t, t2d, target, cfg, Path(tmp) / f"upstream{repeat}")
            runs.append((repeat, recipe, secs, timer))
            report(runs)
            ours_args = {"states": {"mode": "offline", "paths": manifests}, "d2t": d2t, "t2d": t2d, "target": target.to_dict(), "training": cfg,
                         "state_dir": str(Path(tmp) / f"ours{repeat}"), "variant": "bench", "gpus": 1, "num_workers": 8}
            secs, timer = timed(run_training, ours_args)
            runs.append((repeat, ours, secs, timer))
            report(runs)
        if args.profile:
            profile_args = {**ours_args, "training": {**cfg, "epochs": 1}, "state_dir": str(Path(tmp) / "profiled")}
            report(runs, profile_steps(run_training, profile_args, args.profile))


if __name__ == "__main__":
    main()
