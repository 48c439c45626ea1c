"""Train the EAGLE-3 draft with speculators 0.3.0's own Trainer, data loading and packing.

draftsmith adds only what speculators 0.3.0 lacks, each chosen by probing:
- CPU: FlexAttention has no backward there, so the draft's layers use the dense-mask SDPA
  stand-in from `draftsmith.training.attention`; `torch.compile` of the forward is skipped.
- Device moves: the Trainer moves the model with `model.to(local_rank)`, an integer that
  means a CUDA device; draftsmith passes a `torch.device` instead.
- Resume: the single-process checkpointer loads onto "cuda:0"; draftsmith's subclass loads
  onto the training device. Checkpoints are written to a staging directory and renamed, so a
  job killed while saving leaves no half-written epoch to resume from; a save that fails for want
  of disk space (torch.save says only "enforce fail at inline_container.cc") is reported as
  "No space left on device", naming the path and the bytes needed. The state directory
  (`draftsmith.training.state`) records a fingerprint of the training inputs; a run resumes
  only when they are unchanged.
- Metrics: the Trainer logs to the `speculators.metrics` logger; a handler writes them to a
  CSV (per step and per epoch) and drives a plain tqdm bar.
- Matmul precision: the draft trains in float32, and PyTorch's default runs float32 matmuls
  without tensor cores (on an H200 most of a step went to SIMT sgemm kernels).
  `training.tf32` (default on) runs them, and FlexAttention's, in TF32 for the training run.
Training targets come from the last stored layer, which draftsmith's shards store after
the final norm (speculators 0.3.0's own generator stored it before the norm).
"""

from __future__ import annotations

import csv
import errno
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.extraction.shards import read_manifest, shard_files, validate_shard
from draftsmith.io import write_json
from draftsmith.provenance import same_model
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.state import (
    CHECKPOINTS,
    METRICS,
    drop_metrics_from,
    export_checkpoint,
    prepare_state,
    training_fingerprint,
)
from draftsmith.vocab import load_vocab_map

log = logging.getLogger(__name__)


class TrainingInputError(ValueError):
    """Inputs that cannot train a draft for this target; the message says which and why."""


def check_inputs(manifest_paths: list[str], d2t: torch.Tensor, t2d: torch.Tensor, target: TargetSpec) -> dict:
    """Check shards, vocab map and target fit together; return the shared shard facts."""
    if not manifest_paths:
        raise TrainingInputError("no shard manifests given: nothing to train on")
    target_config = target.load_text_config()
    fingerprint = target.fingerprint()
    facts = None
    for path in manifest_paths:
        m = read_manifest(path)
        mine = {"aux_layer_ids": m["aux_layer_ids"], "hidden_size": m["hidden_size"]}
        if not same_model(m["model"], fingerprint):
            raise TrainingInputError(f"{path}: shard was extracted from a different target model ({m['model'].get('path')}), not {target.model}")
        if facts is None:
            facts = mine
        elif mine != facts:
            raise TrainingInputError(f"{path}: layer set {mine} differs from other shards' {facts}")
        if m["num_samples"] == 0:
            raise TrainingInputError(f"{path}: shard has no samples")
    if facts["hidden_size"] != target_config.hidden_size:
        raise TrainingInputError(f"shards have hidden size {facts['hidden_size']}, target has {target_config.hidden_size}")
    if t2d.shape[0] != target_config.vocab_size:
        raise TrainingInputError(f"t2d covers {t2d.shape[0]} tokens but the target vocabulary has {target_config.vocab_size}")
    if int(t2d.sum()) != d2t.shape[0]:
        raise TrainingInputError(f"t2d marks {int(t2d.sum())} tokens but d2t has {d2t.shape[0]} entries")
    if d2t.shape[0] > target_config.vocab_size:
        raise TrainingInputError(f"draft vocabulary {d2t.shape[0]} is larger than the target's {target_config.vocab_size}")
    return facts


def split_train_val(files: list[str], lengths: list[int], val_fraction: float, seed: int):
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    n_val = int(round(val_fraction * len(files))) if len(files) > 1 else 0
    n_val = min(max(n_val, 1 if val_fraction > 0 and len(files) > 1 else 0), len(files) - 1)
    val, train = sorted(order[:n_val]), sorted(order[n_val:])
    return ([files[i] for i in train], [lengths[i] for i in train]), ([files[i] for i in val], [lengths[i] for i in val])


def training_split(manifest_paths: list[str], cfg: dict):
    """(manifests, (train files, lengths), (val files, lengths)): the validation split first, then a seeded
    `data_fraction` of the rest, so that variants at several fractions are validated on the same samples."""
    manifests = [read_manifest(p) for p in manifest_paths]
    files = shard_files(manifest_paths)
    lengths = [e["num_tokens"] for m in manifests for e in m["samples"]]
    (train_files, train_lengths), val = split_train_val(files, lengths, cfg["val_fraction"], cfg["seed"])
    if cfg["data_fraction"] < 1:
        n = max(1, round(cfg["data_fraction"] * len(train_files)))
        keep = sorted(random.Random(f"{cfg['seed']}:data_fraction").sample(range(len(train_files)), n))
        train_files, train_lengths = [train_files[i] for i in keep], [train_lengths[i] for i in keep]
    return manifests, (train_files, train_lengths), val


def make_loader(files, lengths, total_seq_length, noise_std, world_size, rank, seed, num_workers, pin_memory):
    from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from speculators.train.noise_transforms import AddUniformNoise
    from torch.utils.data import DataLoader

    # Noise on the auxiliary inputs only: the targets (last layer) stay the target's exact states.
    transform = AddUniformNoise(std=noise_std, tensors=("hidden_states",)) if noise_std > 0 else None
    dataset = Eagle3SampleFileDataset(max_len=total_seq_length, file_list=files, transform=transform)
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_length,
        lengths=[n - 1 for n in lengths],  # exact lengths from the manifests (after the one-token shift)
        num_replicas=world_size,
        rank=rank,
        seed=seed,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=create_collate_fn(total_seq_length),
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
    )


class MetricsCSV(logging.Handler):
    """Receives speculators' metric records; appends rows to a CSV and advances a progress bar."""

    def __init__(self, path: Path, variant: str, ttt_steps: int, bar: tqdm | None):
        super().__init__()
        self.path, self.variant, self.bar = path, variant, bar
        keys = [f"{kind}_{i}" for kind in ("loss", "full_acc", "cond_acc") for i in range(ttt_steps)]
        # wall: the Unix time the record arrived, so step times and pauses (validation, checkpoints) show in the CSV
        self.columns = ["variant", "split", "epoch", "step", "lr", "loss"] + keys + ["wall"]
        if not self.path.exists():
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self.columns)

    def emit(self, record: logging.LogRecord):
        msg, step = record.msg, getattr(record, "step", None)
        if not isinstance(msg, dict):
            return
        if "train" in msg:
            row = {"split": "train", "lr": msg.get("lr"), **msg["train"]}
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(epoch=msg["epoch"], loss=f"{msg['train'].get('loss', float('nan')):.3f}")
        elif "val" in msg:
            row = {"split": "val", **{k.removesuffix("_epoch"): v for k, v in msg["val"].items()}}
            log.info("epoch %d validation: %s", msg["epoch"], ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "split"))
        else:
            return
        row.update(variant=self.variant, epoch=msg["epoch"], step=step, wall=f"{time.time():.3f}")
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in self.columns])


def checkpoint_bytes(model, optimizer) -> int:
    """About what one checkpoint takes: the model's and the optimizer's floating-point state in bfloat16
    (speculators' checkpointer converts both), other tensors as they are."""
    tensors = [*model.state_dict().values()]
    for state in optimizer.state_dict().get("state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors)


def _chain(error: BaseException):
    """`error` and the exceptions it was raised from or while handling."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            yield e
            todo += [e.__cause__, e.__context__]


def _names_enospc(error: BaseException) -> bool:
    return any((isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
               or "os error 28" in str(e) for e in _chain(error))


@contextmanager
def checkpoint_disk_errors(target: Path, needed_bytes, epoch: int):
    """Around the save of one checkpoint into `target` (a staging directory): a failure removes the partial
    save and, when it was for want of space (ENOSPC anywhere in the error's chain, or less room left on the
    filesystem than the checkpoint needs), re-raises it as OSError(ENOSPC) naming the path and the bytes
    needed. torch.save's own error on a full disk says only "enforce fail at inline_container.cc"."""
    try:
        yield
    except Exception as e:
        # the finished frames of the failed save hold its open files (torch.save's writer): let them go, so that the
        # partial save's space comes back and the free space below is what the next attempt will find
        for error in _chain(e):
            traceback.clear_frames(error.__traceback__)
        shutil.rmtree(target, ignore_errors=True)  # nothing half-written left
        existing = next((p for p in (target, *target.parents) if p.exists()), Path("/"))
        free = shutil.disk_usage(existing).free
        try:
            needed = int(needed_bytes())
        except Exception:  # noqa: BLE001 - the estimate must not hide the original error
            needed = 0
        if _names_enospc(e) or free < needed:
            raise OSError(errno.ENOSPC, f"No space left on device: saving the checkpoint of epoch {epoch} into {target} "
                          f"needs about {needed} bytes, {free} are free there ({type(e).__name__}: {e}). Earlier "
                          "checkpoints are intact: free space and re-run, and training resumes from the last one",
                          str(target)) from e
        raise


def make_trainer_class():
    from speculators.train.checkpointer import SingleGPUCheckpointer, convert_float_dtype, load_safetensors_state_dict
    from speculators.train.trainer import Trainer

    class DeviceCheckpointer(SingleGPUCheckpointer):
        """Loads single-process checkpoints onto the training device (0.3.0 hard-codes cuda:0)."""

        device = "cpu"

        def load_model_state_dict(self, model, float_dtype=None):
            state = load_safetensors_state_dict(self.model_path(self.previous_epoch), str(self.device))
            model.load_state_dict(convert_float_dtype(state, float_dtype or model.dtype), strict=False)

        def load_optimizer_state_dict(self, model, optimizer, float_dtype=None):
            state = torch.load(self.optimizer_path(self.previous_epoch), weights_only=True, map_location=self.device)
            optimizer.load_state_dict(convert_float_dtype(state, float_dtype or model.dtype))

    class DraftTrainer(Trainer):
        def setup_trainer(self):
            if not self.is_distributed:
                self.checkpointer = DeviceCheckpointer(self.config.save_path)
                self.checkpointer.device = self.config.local_rank
            super().setup_trainer()
            # 0.3.0 restarts the step counter at 0 on resume; keep steps global across runs
            self.global_step = self.current_epoch * len(self.train_loader)

        def save_checkpoint(self, epoch: int):
            final_root = self.checkpointer.path
            staging = final_root / ".staging"
            self.checkpointer.path = staging
            try:
                with checkpoint_disk_errors(staging / str(epoch), lambda: checkpoint_bytes(self.model, self.opt), epoch):
                    super().save_checkpoint(epoch)
            finally:
                self.checkpointer.path = final_root
            if not self.is_distributed or torch.distributed.get_rank() == 0:
                shutil.rmtree(final_root / str(epoch), ignore_errors=True)
                os.replace(staging / str(epoch), final_root / str(epoch))
            if self.is_distributed:
                torch.distributed.barrier()

    return DraftTrainer


def use_cpu_attention(model) -> None:
    from draftsmith.training.attention import register

    name = register()
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = name


@contextmanager
def matmul_precision(tf32: bool):
    """float32 matmuls (FlexAttention's included) in TF32 on CUDA tensor cores, or in full float32, for the
    duration; the previous setting after. torch.compile guards on it, so compiled code matches the setting."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def run_training(args: dict) -> None:
    """One training process (all ranks run this under torchrun)."""
    from speculators.train.trainer import TrainerConfig
    from speculators.train.utils import maybe_destroy_distributed, maybe_setup_distributed

    from draftsmith.training.attention import flex_attention_trains_on
    from draftsmith.training.draft_model import build_draft

    cfg = args["training"]
    local_rank, world_size, rank, is_distributed = maybe_setup_distributed()
    use_cuda = args["gpus"] > 0 and torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    d2t, t2d = (m.to(device) for m in load_vocab_map(args["d2t"], args["t2d"]))
    manifests, (train_files, train_lengths), (val_files, val_lengths) = training_split(args["manifests"], cfg)
    aux_layer_ids = manifests[0]["aux_layer_ids"]
    log.info("training on %d samples (%d tokens; data_fraction %s) from %d shards; %d samples held out for validation",
             len(train_files), sum(train_lengths), cfg["data_fraction"], len(manifests), len(val_files))

    torch.manual_seed(cfg["seed"])
    draft = build_draft(TargetSpec.from_dict(args["target"]), d2t, t2d, cfg["draft_layers"], aux_layer_ids,
                        cfg["ttt_steps"], cfg["seed"])
    if not flex_attention_trains_on(device):
        log.info("FlexAttention has no backward on %s: using the dense-mask SDPA stand-in, without torch.compile", device)
        use_cpu_attention(draft)
        torch._dynamo.config.disable = True

    num_workers = args["num_workers"]
    loader_args = dict(world_size=world_size, rank=rank, seed=cfg["seed"], num_workers=num_workers, pin_memory=use_cuda)
    train_loader = make_loader(train_files, train_lengths, cfg["total_seq_length"], cfg["noise_std"], **loader_args)
    val_loader = make_loader(val_files, val_lengths, cfg["total_seq_length"], 0.0, **loader_args) if val_files else None

    state_dir = Path(args["state_dir"])
    checkpoints = state_dir / CHECKPOINTS
    metrics_path = state_dir / METRICS
    state_dir.mkdir(parents=True, exist_ok=True)
    call_kwargs = {"use_off_policy_tokens": False, "ttt_steps": cfg["ttt_steps"], "ttt_step_loss_decay": cfg["ttt_step_loss_decay"]}
    trainer_config = TrainerConfig(
        lr=cfg["lr"],
        num_epochs=cfg["epochs"],
        save_path=str(checkpoints),
        resume_from_checkpoint=cfg["resume"],
        is_distributed=is_distributed,
        local_rank=device,
        train_call_kwargs=call_kwargs,
        val_call_kwargs=call_kwargs,
        scheduler_type=cfg["scheduler"],
        scheduler_warmup_steps=cfg["warmup_steps"],
    )
    metric_logger = logging.getLogger("speculators.metrics")
    metric_logger.setLevel(logging.INFO)
    metric_logger.propagate = False  # one dict per step would flood the rule's log; MetricsCSV keeps them
    bar = None
    handler = None
    if use_cuda:
        log.info("float32 matmuls in %s (training.tf32)", "TF32 on tensor cores" if cfg["tf32"] else "full float32")
    try:
        DraftTrainer = make_trainer_class()
        trainer = DraftTrainer(draft, trainer_config, train_loader, val_loader)
        if rank == 0:
            drop_metrics_from(metrics_path, trainer.current_epoch)
            total = cfg["epochs"] * len(train_loader)
            bar = tqdm(total=total, initial=trainer.current_epoch * len(train_loader), desc="train draft", unit="step", mininterval=5)
            handler = MetricsCSV(metrics_path, args["variant"], cfg["ttt_steps"], bar)
            metric_logger.addHandler(handler)
            if trainer.current_epoch:
                log.info("resuming from the checkpoint of epoch %d", trainer.current_epoch - 1)
        with matmul_precision(cfg["tf32"]):
            trainer.run_training()
    finally:
        if handler is not None:
            metric_logger.removeHandler(handler)
        if bar is not None:
            bar.close()
        maybe_destroy_distributed()


def data_summary(manifests: list[str], training: dict) -> dict:
    """What the draft was trained on (the report's data-size figure reads it)."""
    _, (train_files, train_lengths), (val_files, val_lengths) = training_split(manifests, training)
    return {"datasets": sorted({Path(m).parent.parent.name for m in manifests}),  # shards/<dataset>/shard_k/manifest.json
            "data_fraction": training["data_fraction"], "train_samples": len(train_files),
            "train_tokens": int(sum(train_lengths)), "val_samples": len(val_files), "val_tokens": int(sum(val_lengths)),
            "epochs": training["epochs"], "ttt_steps": training["ttt_steps"]}


def train_draft(manifests: list[str], d2t: str, t2d: str, target: TargetSpec, training: dict, state_dir: str, variant: str,
                gpus: int, out_config: str, out_weights: str, out_metrics: str, out_data: str) -> None:
    """Validate inputs, train (in process, or under torchrun for gpus > 1), export the checkpoint."""

    check_inputs(manifests, *load_vocab_map(d2t, t2d), target)
    for m in manifests:
        validate_shard(Path(m).parent, deep=True)
    prepare_state(Path(state_dir), training_fingerprint(manifests, d2t, t2d, target, training, gpus), training["resume"])
    args = {"manifests": list(map(str, manifests)), "d2t": str(d2t), "t2d": str(t2d), "target": target.to_dict(),
            "training": training, "state_dir": str(state_dir), "variant": variant, "gpus": gpus,
            "num_workers": min(8, max(0, (os.cpu_count() or 1) // max(1, gpus) - 1)) if gpus > 0 else 0}
    if gpus > 1:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        args_path = Path(state_dir) / "args.json"
        args_path.write_text(json.dumps(args))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
               "-m", "draftsmith.training.trainer", str(args_path)]
        log.info("launching FSDP training: %s", " ".join(cmd))
        subprocess.run(cmd, check=True)
    else:
        run_training(args)
    export_checkpoint(Path(state_dir), training["epochs"], Path(out_config), Path(out_weights), Path(out_metrics))
    write_json(out_data, data_summary(manifests, training))


if __name__ == "__main__":  # torchrun entry point: python -m draftsmith.training.trainer ARGS_JSON
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_training(json.loads(Path(sys.argv[1]).read_text()))
