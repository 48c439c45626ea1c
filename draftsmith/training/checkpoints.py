"""What an exact resume needs beside speculators' checkpoint: the RNG states, the weights in the model's own dtype and
the optimizer state undemoted, and a save that fails for want of disk space reported as such, leaving nothing
half-written."""

from __future__ import annotations

import errno
import random
import shutil
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from draftsmith.training.state import RESUME_DIR, RESUME_WEIGHTS


def rng_states(device: torch.device) -> dict:
    """Every process-wide RNG state the remaining epochs could draw from (in types `torch.load(weights_only=True)` reads)."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "python": random.getstate(),
              "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = states["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def write_checkpoint_files(model, model_state: dict, optimizer_state: dict, directory: Path, optimizer_path: Path,
                           float_dtype: torch.dtype) -> None:
    """What speculators' checkpointers write, plus the full-precision weights; the optimizer state is not demoted."""
    from safetensors.torch import save_file
    from speculators.train.checkpointer import convert_float_dtype

    # the served draft, exactly as speculators 0.3.0 writes it (bfloat16 by default)
    model.save_pretrained(directory, state_dict=convert_float_dtype(model_state, float_dtype))
    skip = set(getattr(model, "_keys_to_ignore_on_save", None) or ())  # the verifier's lm_head, rebuilt from the target
    (directory / RESUME_DIR).mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items() if k not in skip},
              directory / RESUME_DIR / RESUME_WEIGHTS)
    torch.save(optimizer_state, optimizer_path)


def load_full_weights(model, path: Path, device: str) -> dict:
    """The full-precision weights of a checkpoint, checked to cover the model (all but the keys it never saves)."""
    from speculators.train.checkpointer import load_safetensors_state_dict

    state = load_safetensors_state_dict(path, device)
    expected = set(model.state_dict()) - set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    if set(state) != expected:
        raise RuntimeError(f"{path}: weights do not match the model (missing {sorted(expected - set(state))}, "
                           f"unexpected {sorted(set(state) - expected)})")
    return state


def checkpoint_bytes(model, optimizer) -> int:
    """About what one checkpoint takes (write_checkpoint_files): the served weights in bfloat16, the weights and the
    optimizer state in their own dtypes."""
    weights = list(model.state_dict().values())
    optimizer_tensors = [v for state in optimizer.state_dict().get("state", {}).values() for v in state.values()
                         if isinstance(v, torch.Tensor)]
    return sum(t.numel() * 2 for t in weights if t.is_floating_point()) + sum(
        t.numel() * t.element_size() for t in weights + optimizer_tensors)


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
