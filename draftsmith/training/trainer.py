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
- Exact resume: speculators 0.3.0 saves weights and Adam state (its step counter included) in
  bfloat16, saves no RNG state, restarts the step counter, and its scheduler set-up overwrites the
  resumed optimizer's learning rate with the schedule's value at step `epoch`. draftsmith's
  checkpointers keep `model.safetensors` as speculators writes it (bfloat16: the served draft) and
  add `resume/model.safetensors` in the model's own dtype, write the optimizer state undemoted,
  and save per rank the torch CPU/CUDA, Python and NumPy RNG states, the global step and the
  learning rates, restored just before the first resumed epoch. The uniform noise on the
  auxiliary states is drawn per sample from a generator seeded by (seed, epoch, sample index),
  not from the process-wide generator (DataLoader workers' generators cannot be saved), so it
  is the same in a resumed run whatever the worker count (draftsmith.training.loader). On CPU a resumed run
  reproduces an uninterrupted one bit for bit (the checkpoint files: draftsmith.training.checkpoints).
- Metrics: the Trainer logs to the `speculators.metrics` logger; a handler writes them to a
  CSV (per step and per epoch) and drives a plain tqdm bar (draftsmith.training.metrics).
- Matmul precision: the draft trains in float32, and PyTorch's default runs float32 matmuls
  without tensor cores (on an H200 most of a step went to SIMT sgemm kernels).
  `training.tf32` (default on) runs them, and FlexAttention's, in TF32 for the training run.
Training targets come from the last stored layer, which draftsmith's shards store after
the final norm (speculators 0.3.0's own generator stored it before the norm).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.compiling import compile_totals, describe
from draftsmith.extraction.shards import validate_shard
from draftsmith.io import write_json
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.checkpoints import (
    checkpoint_bytes,
    checkpoint_disk_errors,
    load_full_weights,
    rng_states,
    set_rng_states,
    write_checkpoint_files,
)
from draftsmith.training.loader import make_loader, training_split
from draftsmith.training.metrics import MetricsCSV, final_validation
from draftsmith.training.sources import TrainingInputError, check_source, states_source
from draftsmith.training.state import (
    CHECKPOINTS,
    METRICS,
    RESUME_DIR,
    RESUME_FORMAT,
    RESUME_MARKER,
    RESUME_WEIGHTS,
    drop_metrics_from,
    export_checkpoint,
    inexact_resume_reason,
    prepare_state,
    resume_rank_file,
    training_fingerprint,
)
from draftsmith.vocab import load_vocab_map

log = logging.getLogger(__name__)


def check_inputs(states, d2t: torch.Tensor, t2d: torch.Tensor, target: TargetSpec) -> None:
    """Check the hidden-state source (or shard manifests), vocab map and target fit together."""
    check_source(states_source(states), d2t, t2d, target)


def make_trainer_class():
    import torch.distributed as dist
    from speculators.train.checkpointer import DistributedCheckpointer, SingleGPUCheckpointer
    from speculators.train.trainer import Trainer
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    class DeviceCheckpointer(SingleGPUCheckpointer):
        """Loads single-process checkpoints onto the training device (0.3.0 hard-codes cuda:0), in full precision."""

        device = "cpu"

        def load_model_state_dict(self, model, float_dtype=None):
            path = self.path / str(self.previous_epoch) / RESUME_DIR / RESUME_WEIGHTS
            model.load_state_dict(load_full_weights(model, path, str(self.device)), strict=False)

        def load_optimizer_state_dict(self, model, optimizer, float_dtype=None):
            optimizer.load_state_dict(torch.load(self.optimizer_path(self.previous_epoch), weights_only=True,
                                                 map_location=self.device))

        def save_checkpoint(self, model, optimizer, epoch, float_dtype=torch.bfloat16):
            write_checkpoint_files(model, model.state_dict(), optimizer.state_dict(), self.path / str(epoch),
                                   self.optimizer_path(epoch), float_dtype)

    class FullPrecisionDistributedCheckpointer(DistributedCheckpointer):
        """speculators 0.3.0's FSDP checkpointer without the demotion to bfloat16 (same state-dict calls otherwise)."""

        def load_model_state_dict(self, model, float_dtype=None):
            path = self.path / str(self.previous_epoch) / RESUME_DIR / RESUME_WEIGHTS
            set_model_state_dict(model, load_full_weights(model, path, "cpu"),
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
            dist.barrier()

        def load_optimizer_state_dict(self, model, optimizer, float_dtype=None):
            state = torch.load(self.optimizer_path(self.previous_epoch), mmap=True, weights_only=True, map_location="cpu")
            set_optimizer_state_dict(model, optimizer, state,
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            dist.barrier()

        def save_checkpoint(self, model, optimizer, epoch, float_dtype=torch.bfloat16):
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state = get_model_state_dict(model, options=options)
            optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
            if dist.get_rank() == 0:
                write_checkpoint_files(model, model_state, optimizer_state, self.path / str(epoch),
                                       self.optimizer_path(epoch), float_dtype)
            dist.barrier()

    class DraftTrainer(Trainer):
        def setup_trainer(self):
            if self.is_distributed:
                self.checkpointer = FullPrecisionDistributedCheckpointer(self.config.save_path)
            else:
                self.checkpointer = DeviceCheckpointer(self.config.save_path)
                self.checkpointer.device = self.config.local_rank
            self.rank = torch.distributed.get_rank() if self.is_distributed else 0
            self.device = torch.device(self.config.local_rank)
            super().setup_trainer()
            self.resume_state = None
            if self.resume_from_checkpoint and self.checkpointer.previous_epoch != -1:
                self.resume_state = self.load_resume_state()
                # 0.3.0 restarts the step counter at 0 on resume (and epochs differ in length): restore it
                self.global_step = self.resume_state["global_step"]

        def load_resume_state(self) -> dict:
            # prepare_state has already started afresh from any checkpoint this would refuse
            reason = inexact_resume_reason(self.checkpointer.path, self.device.type)
            if reason is not None:
                raise RuntimeError(f"refusing to resume: {reason}")
            return torch.load(self.checkpointer.prev_path / RESUME_DIR / resume_rank_file(self.rank),
                              weights_only=True, map_location="cpu")

        def run_training(self):
            if self.resume_state is not None:
                # 0.3.0 builds the resumed scheduler with last_epoch=<epoch>, which sets the lr to the schedule's
                # value at step <epoch> until its first step; the checkpoint's learning rates are the right ones
                for group, lr in zip(self.opt.param_groups, self.resume_state["lrs"], strict=True):
                    group["lr"] = lr
                set_rng_states(self.resume_state["rng"], self.device)  # last: nothing may draw after it
            super().run_training()

        def save_checkpoint(self, epoch: int):
            # everything the remaining epochs depend on besides weights, optimizer and scheduler, taken first
            resume = {"format": RESUME_FORMAT, "epoch": epoch, "global_step": self.global_step,
                      "lrs": [group["lr"] for group in self.opt.param_groups], "rng": rng_states(self.device)}
            final_root = self.checkpointer.path
            staging = final_root / ".staging"
            if self.rank == 0:
                shutil.rmtree(staging / str(epoch), ignore_errors=True)  # a job killed while saving
            if self.is_distributed:
                torch.distributed.barrier()
            self.checkpointer.path = staging
            try:
                with checkpoint_disk_errors(staging / str(epoch), lambda: checkpoint_bytes(self.model, self.opt), epoch):
                    super().save_checkpoint(epoch)
            finally:
                self.checkpointer.path = final_root
            resume_dir = staging / str(epoch) / RESUME_DIR
            resume_dir.mkdir(parents=True, exist_ok=True)
            torch.save(resume, resume_dir / resume_rank_file(self.rank))
            if self.is_distributed:
                torch.distributed.barrier()
            if self.rank == 0:
                world_size = torch.distributed.get_world_size() if self.is_distributed else 1
                write_json(resume_dir / RESUME_MARKER, {"format": RESUME_FORMAT, "epoch": epoch, "world_size": world_size,
                                                        "device_type": self.device.type, "global_step": self.global_step})
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


def trains_on(gpus: int) -> str:
    """The device type a run with `gpus` GPUs trains on here."""
    return "cuda" if gpus > 0 and torch.cuda.is_available() else "cpu"


def run_training(args: dict) -> None:
    """One training process (all ranks run this under torchrun)."""
    from speculators.train.trainer import TrainerConfig
    from speculators.train.utils import maybe_destroy_distributed, maybe_setup_distributed

    from draftsmith.draft_model import build_draft
    from draftsmith.training.attention import compile_attention_only, flex_attention_trains_on

    cfg = args["training"]
    local_rank, world_size, rank, is_distributed = maybe_setup_distributed()
    use_cuda = trains_on(args["gpus"]) == "cuda"
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    d2t, t2d = (m.to(device) for m in load_vocab_map(args["d2t"], args["t2d"]))
    target = TargetSpec.from_dict(args["target"])
    source, (train_keys, train_lengths), (val_keys, val_lengths) = training_split(states_source(args["states"]), cfg)
    aux_layer_ids = source.aux_layer_ids(target)
    log.info("training on %d samples (%d tokens; data_fraction %s), hidden states %s from %s; %d samples held out for "
             "validation", len(train_keys), sum(train_lengths), cfg["data_fraction"],
             "computed online by the target on " + str(device) if source.mode == "online" else "read from shards",
             ", ".join(source.paths), len(val_keys))

    torch.manual_seed(cfg["seed"])
    draft = build_draft(target, d2t, t2d, cfg["draft_layers"], aux_layer_ids, cfg["ttt_steps"], cfg["seed"])
    # restored in `finally` below: a caller's later FlexAttention (tests run training in process) needs dynamo
    dynamo_was_disabled = torch._dynamo.config.disable
    if not flex_attention_trains_on(device):
        log.info("FlexAttention has no backward on %s: using the dense-mask SDPA stand-in, without torch.compile", device)
        use_cpu_attention(draft)
        torch._dynamo.config.disable = True
    elif cfg["compile"] == "attention":
        log.info("training.compile: attention: the draft's forward runs eagerly, its FlexAttention compiled alone")
        compile_attention_only(draft)
    else:
        log.info("training.compile: forward: speculators' torch.compile of the draft's whole forward")

    num_workers = args["num_workers"]
    loader_args = dict(world_size=world_size, rank=rank, seed=cfg["seed"], num_workers=num_workers, pin_memory=use_cuda,
                       source=source, device=device, target=target, prefetch_batches=args.get("prefetch_batches"))
    train_loader = make_loader(train_keys, train_lengths, cfg["total_seq_length"], cfg["noise_std"], **loader_args)
    val_loader = make_loader(val_keys, val_lengths, cfg["total_seq_length"], 0.0, **loader_args) if val_keys else None

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
            bar = tqdm(total=total, initial=trainer.global_step, desc="train draft", unit="step", mininterval=5)
            handler = MetricsCSV(metrics_path, args["variant"], cfg["ttt_steps"], bar)
            metric_logger.addHandler(handler)
            if trainer.current_epoch:
                log.info("resuming from the checkpoint of epoch %d (full-precision weights and optimizer state, RNG "
                         "states, step %d)", trainer.current_epoch - 1, trainer.global_step)
        compiled_before = compile_totals()
        with matmul_precision(cfg["tf32"]):
            trainer.run_training()
        compiled_after = compile_totals()
        if rank == 0 and compiled_before is not None and compiled_after is not None:
            log.info(describe(compiled_before, compiled_after))
    finally:
        if handler is not None:
            metric_logger.removeHandler(handler)
        if bar is not None:
            bar.close()
        torch._dynamo.config.disable = dynamo_was_disabled
        maybe_destroy_distributed()


def data_summary(states, training: dict) -> dict:
    """What the draft was trained on (the report's data-size figure reads it)."""
    source, (train_keys, train_lengths), (val_keys, val_lengths) = training_split(states, training)
    return {"datasets": source.datasets, "hidden_states": source.mode,
            "data_fraction": training["data_fraction"], "train_samples": len(train_keys),
            "train_tokens": int(sum(train_lengths)), "val_samples": len(val_keys), "val_tokens": int(sum(val_lengths)),
            "epochs": training["epochs"], "ttt_steps": training["ttt_steps"]}


def train_draft(states, d2t: str, t2d: str, target: TargetSpec, training: dict, state_dir: str, variant: str,
                gpus: int, out_config: str, out_weights: str, out_metrics: str, out_data: str) -> None:
    """Validate inputs, train (in process, or under torchrun for gpus > 1), export the checkpoint. `states`: a
    hidden-state source (draftsmith.training.sources) or a list of shard manifests."""
    source = states_source(states)
    check_inputs(source, *load_vocab_map(d2t, t2d), target)
    if source.mode == "offline":
        for m in source.paths:  # checksums: their contents were checked in memory when they were extracted
            validate_shard(Path(m).parent, deep=False)
    prepare_state(Path(state_dir), training_fingerprint(source, d2t, t2d, target, training, gpus), training["resume"],
                  trains_on(gpus))
    args = {"states": source.to_dict(), "d2t": str(d2t), "t2d": str(t2d), "target": target.to_dict(),
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
    # the last validation's accuracies and the acceptance they predict, beside what the draft trained on
    write_json(out_data, {**data_summary(source, training), "validation": final_validation(Path(out_metrics))})


if __name__ == "__main__":  # torchrun entry point: python -m draftsmith.training.trainer ARGS_JSON
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_training(json.loads(Path(sys.argv[1]).read_text()))
