"""Batches loaded ahead, in a thread, while the training step runs (online hidden states: the target's forward).

Online, loading a batch is the target's forward on the training device (draftsmith.training.online), and the
DataLoader cannot run it in worker processes. Loaded in the training loop, the device would wait for it each step,
and the step's own host work would wait for the forward's. A `PrefetchingLoader` runs the DataLoader's iterator in
one thread, up to `depth` batches ahead, on a CUDA stream of its own: the target's kernels fill the device's gaps in
the draft's step (its backward and its `.item()` syncs release the GIL). The batches and their order are the
DataLoader's own; the consumer's stream waits for each batch's event before it reads it, and the batch's tensors are
recorded on that stream so the allocator does not hand their memory back to the loading stream while the step uses it.
"""

from __future__ import annotations

import queue
import threading
from contextlib import nullcontext

import torch

_DONE = object()


class PrefetchingLoader:
    """A DataLoader (its `batch_sampler`, `len` and iteration), iterated `depth` batches ahead in a thread."""

    def __init__(self, loader, depth: int, device):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.loader, self.depth, self.device = loader, depth, torch.device(device)

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    @property
    def dataset(self):
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                if cuda:
                    torch.cuda.set_device(self.device)
                with torch.cuda.stream(stream) if cuda else nullcontext():
                    for batch in self.loader:
                        event = None
                        if cuda:
                            event = torch.cuda.Event()
                            event.record(stream)
                        if not put((batch, event)):
                            return
                put(_DONE)
            except BaseException as err:  # raised in the consumer, where the training loop sees it
                put(err)

        thread = threading.Thread(target=produce, name="prefetch-batches", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, event = item
                if event is not None:
                    consumer = torch.cuda.current_stream(self.device)
                    consumer.wait_event(event)
                    for value in batch.values():
                        if isinstance(value, torch.Tensor) and value.is_cuda:
                            value.record_stream(consumer)
                yield batch
        finally:
            stop.set()
            thread.join()

