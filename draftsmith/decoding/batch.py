"""Batched decoding with continuous refill over a static KV cache (regenerate's fast path).

`BatchDecoder.generate` answers many prompts with `batch_size` rows decoding side by side. Each row holds one
sequence: its prompt left-padded into the row's cache slots (`starts`: where the prompt begins), its own write
slot, its own position ids (slot - start) and its own mask (slots start..slot). A decode step advances every row
by one token on the device alone: the model's forward, the choice of the next token, the row's output buffer, its
length and its stop check. So on CUDA the step is captured once as a CUDA graph and replayed, `sync_every` steps to
a window, and the host looks at each window's row state (copied asynchronously) while the device decodes the next
one: a row whose answer ended (a stop token or max_new_tokens) hands its answer back and takes the next prompt in
the window after (a batched prefill of every free row), so early end-of-turn idles a row for about two windows, and
the host's bookkeeping and the prefill's kernel launches overlap the device's steps, as long as nothing in the loop
blocks the host (see `on_device`; the host's time per part of the loop is counted, `host_seconds`). The same code
runs eagerly on a CPU, where the tests compare it with `generate`.

Rows are independent: a row's tokens depend on its prompt (and for sampling its seed) alone, not on which prompts
share the batch or when it was refilled.

The cache, its masks and the attention functions are draftsmith.decoding.batch_kv; the token choice is
draftsmith.decoding.sampling.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from contextlib import contextmanager

import torch

from draftsmith.decoding.batch_kv import (
    GROUPED_SDPA,
    RAGGED_DECODE,
    BatchKV,
    attention_configs,
    grouped_attention,
    left_padded,
    on_device,
    prefill_layout,
    row_mask,
)
from draftsmith.decoding.sampling import Sampling, choose_tokens
from draftsmith.decoding.static_cache import CapturedStep, attention_span, full_attention_sdpa, keeps_logits

log = logging.getLogger(__name__)

SLOT_GRANULE = 64  # cache length rounded up to this, so chunks of similar prompts share one cache
# tokens (rows x the longest prompt) one prefill forward takes at most: its mask grows with rows x width^2, and a
# refill of 2,048 rows of 1,024-token prompts in one forward would need ~60 GB for the mask alone
PREFILL_LIMIT = 32768


class Look:
    """The decoder's row state (finished, lengths, output) as of the end of one window of decode steps, copied into
    one of two host buffers; on CUDA the copy is asynchronous and `read` waits for it."""

    def __init__(self, decoder: "BatchDecoder", window: int):
        self.window = window
        self.finished, self.lengths, self.out = decoder._host[window % 2]
        cuda = decoder.device.type == "cuda"
        for host, tensor in zip((self.finished, self.lengths, self.out), (decoder.finished, decoder.lengths, decoder.out)):
            host.copy_(tensor, non_blocking=cuda)
        self.event = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()

    def read(self) -> tuple[list[int], list[int]]:
        """The finished rows and every row's length."""
        if self.event is not None:
            self.event.synchronize()
        return self.finished.nonzero().flatten().tolist(), self.lengths.tolist()


class BatchDecoder:
    """Decodes prompts `batch_size` at a time on `model` (a full-attention SDPA causal LM, already on its device),
    refilling each row as its answer ends; `cuda_graphs` replays the decode step on CUDA. `compile_sampler` hands
    the decode step's token choice to torch.compile (fused kernels: each bisection step of the nucleus reads the
    vocabulary once instead of three times); the first step compiles it, outside any graph capture.
    `compile_layers` compiles the model's RMSNorm and MLP modules in place (their elementwise kernels fused; their
    shapes do not change with the attention span, so the decode steps' graphs share one compiled version).
    `ragged` decode steps attend to each row's own slots (draftsmith.decoding.ragged_attention, a Triton kernel)
    instead of every row to the busy rows' common span, one graph for every step. A refill's prefill runs in forwards
    of at most `prefill_limit` tokens (distinct prompts x their longest: a prompt's repeats share one), so that a
    large batch of long prompts needs no more memory to start than a small one."""

    def __init__(self, model, batch_size: int, cuda_graphs: bool | None = None, sync_every: int = 8,
                 compile_sampler: bool = False, compile_layers: bool = False, prefill_limit: int = PREFILL_LIMIT,
                 ragged: bool = False):
        if not full_attention_sdpa(model):
            raise ValueError("the batched decoder needs a full-attention SDPA model (no sliding windows)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.device = next(model.parameters()).device
        self.batch_size = batch_size
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device (here {self.device.type})")
        self.sync_every = max(1, sync_every)
        if prefill_limit < 1:
            raise ValueError(f"prefill_limit must be >= 1, got {prefill_limit}")
        self.prefill_limit = prefill_limit
        if ragged:
            from draftsmith.decoding.ragged_attention import ragged_attention_available

            problem = ragged_attention_available(self.device)
            if problem:
                raise ValueError(f"ragged decode steps: {problem}")
        self.ragged = ragged
        self._keeps_logits = keeps_logits(model)
        self._choose = torch.compile(choose_tokens, dynamic=False) if compile_sampler else choose_tokens
        if compile_layers:
            for module in model.modules():
                if type(module).__name__.endswith(("RMSNorm", "MLP")):
                    module.compile()
        self._configs = attention_configs(model)
        self._shape = None  # (cache length, max_new_tokens, sampling, stops) of the state below
        self._graphs: dict[int, CapturedStep] = {}  # by attention span
        self._pool = None
        self.decode_steps = 0  # counters, for throughput reports
        self.span_steps: Counter = Counter()  # decode steps by attention span
        # row-steps of busy rows and the slots their sequences filled (summed at each window's start): beside the
        # span, how much of what a step's attention reads is padding (free rows and slots outside a row's sequence)
        self.busy_row_steps = 0
        self.filled_slot_steps = 0
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0  # on CUDA: the device's time in prefills
        self.decode_seconds = 0.0  # on CUDA: the device's time in decode steps (a run's wall time less both: idle)
        self.host_wait_seconds = 0.0  # the host's time waiting for the device (each window's row state)
        # the host's time in each part of the loop besides that wait: "refill" (prefills launched), "launch" (a
        # window's steps launched), "look" (a window's finished rows handed back): where it is the bottleneck
        self.host_seconds: Counter = Counter()
        self._events: dict[str, list] = {"prefill": [], "decode": []}  # (start, end) CUDA events, read at the end

    def counters(self) -> dict:
        """The running counters, for throughput reports: the difference of two readings covers the calls between."""
        return {"decode_steps": self.decode_steps, "span_steps": self.span_steps.copy(),
                "busy_row_steps": self.busy_row_steps, "filled_slot_steps": self.filled_slot_steps,
                "prefill_tokens": self.prefill_tokens, "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds,
                "host_wait_seconds": self.host_wait_seconds, "host_seconds": self.host_seconds.copy()}

    # ------------------------------------------------------------------ state
    def _reset(self, length: int, max_new_tokens: int, sampling: Sampling, stop_ids: list[int]) -> None:
        shape = (length, max_new_tokens, sampling, tuple(stop_ids))
        if shape == self._shape:
            self.finished.fill_(True)
            self.slots.zero_()
            self.starts.zero_()
            return
        self._graphs.clear()
        self._shape = shape
        rows, device = self.batch_size, self.device

        def zeros(*size, dtype=torch.long):
            return torch.zeros(size, dtype=dtype, device=device)

        self.cache = BatchKV(rows, length)
        self.length, self.max_new_tokens, self.sampling = length, max_new_tokens, sampling
        self.tokens, self.slots, self.starts, self.lengths, self.seeds = (zeros(rows) for _ in range(5))
        self.finished = torch.ones(rows, dtype=torch.bool, device=device)  # a finished row is free
        self.out = zeros(rows, max_new_tokens)
        self.stops = torch.tensor(stop_ids or [-1], dtype=torch.long, device=device)
        self.all_rows = torch.arange(rows, device=device)
        self.cache_position = zeros(1)
        self.cache.decode_slots = self.slots
        pinned = device.type == "cuda"
        self._host = [tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
                            for t in (self.finished, self.lengths, self.out)) for _ in range(2)]

    def _forward(self, input_ids, mask, position_ids, cache_position, implementation: str = GROUPED_SDPA):
        extra = {"logits_to_keep": 1} if self._keeps_logits else {}
        with grouped_attention(self._configs, implementation):
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                             cache_position=cache_position, past_key_values=self.cache, use_cache=True, **extra)
        return out.logits[:, -1]

    def _choose_step(self, logits: torch.Tensor) -> torch.Tensor:
        try:
            return self._choose(logits, self.sampling, self.seeds, self.lengths)
        except Exception as err:  # a compiler that fails does so on the first (eager, uncaptured) step
            if self._choose is choose_tokens:
                raise
            log.warning("torch.compile of the token choice failed (%s: %s); choosing eagerly", type(err).__name__, err)
            self._choose = choose_tokens
            return choose_tokens(logits, self.sampling, self.seeds, self.lengths)

    def _is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.stops[None, :]).any(-1)

    # ------------------------------------------------------------------ the two kinds of forward
    def _prefill(self, rows: list[int], prompts: list[list[int]], seeds: list[int]) -> None:
        """Write `prompts` into cache `rows` (left-padded to the longest) and choose each one's first token. A prompt
        that several rows hold (samples of one prompt) runs once: its first row's cache is copied to the others."""
        distinct: dict[tuple, int] = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # each row's distinct prompt
        lead: dict[int, int] = {}  # the row that runs each distinct prompt
        for row, k in zip(rows, which):
            lead.setdefault(k, row)
        ids, starts = left_padded([list(p) for p in distinct], self.device)
        width = ids.shape[1]
        self.prefill_tokens += width * len(distinct)
        index, mask, positions = prefill_layout(starts, width)
        self.cache.prefill_rows = on_device(list(lead.values()), self.device)
        try:
            logits = self._forward(ids, mask, positions, index)
        finally:
            self.cache.prefill_rows = None
        row_ids = on_device(rows, self.device)
        if len(distinct) < len(rows):
            followers = [(lead[k], row) for row, k in zip(rows, which) if lead[k] != row]
            self.cache.copy_rows(*on_device(followers, self.device).T, width)
            pick = on_device(which, self.device)
            logits, starts = logits[pick], starts[pick]
        row_seeds = on_device(seeds, self.device)
        first = choose_tokens(logits, self.sampling, row_seeds, torch.zeros_like(row_seeds))
        self.tokens[row_ids] = first
        self.slots.index_fill_(0, row_ids, width)  # not `[row_ids] = width`: see `on_device`
        self.starts[row_ids] = starts
        self.seeds[row_ids] = row_seeds
        self.lengths.index_fill_(0, row_ids, 1)
        self.out[row_ids, 0] = first
        self.finished[row_ids] = self._is_stop(first) | (self.max_new_tokens <= 1)

    def _step(self, span: int) -> None:
        """One token for every row, on the device alone (what a CUDA graph captures), attending to the first `span`
        slots. A busy row's slot lies below the span; a free row's starts at 0, so its mask is never empty (an
        empty one would give NaN, which a masked slot still spreads: 0 * NaN)."""
        self.cache.span = span
        if self.ragged:  # a free row reads its one write slot: its slots grow each step, and it is never read
            first = torch.where(self.finished, self.slots, self.starts)
            mask, implementation = torch.stack((first, self.slots), -1)[:, None, None, :], RAGGED_DECODE
        else:
            mask, implementation = row_mask(self.slots[:, None], self.starts, span), GROUPED_SDPA
        logits = self._forward(self.tokens[:, None], mask, (self.slots - self.starts)[:, None], self.cache_position,
                               implementation)
        chosen = self._choose_step(logits)
        active = ~self.finished
        at = self.lengths.clamp(max=self.max_new_tokens - 1)
        self.out[self.all_rows, at] = torch.where(active, chosen, self.out[self.all_rows, at])
        self.lengths += active.long()
        self.finished |= active & (self._is_stop(chosen) | (self.lengths >= self.max_new_tokens))
        self.tokens.copy_(chosen)
        self.slots.copy_((self.slots + 1).clamp(max=self.length - 1))  # a free row writes its last slot, unread

    def _steps(self, n: int, span: int) -> int:
        """At least `n` decode steps attending to `span` slots; returns how many ran (capturing a span's graph
        runs two real steps eagerly first, as warm-up)."""
        step, taken = self._graphs.get(span), 0
        if self.cuda_graphs and step is None:
            if self._pool is None:  # the spans' graphs share their memory: one runs at a time
                self._pool = torch.cuda.graph_pool_handle()
            step = self._graphs[span] = CapturedStep(functools.partial(self._step, span), [], pool=self._pool)
            taken = CapturedStep.WARM_UP_RUNS
        for _ in range(n - taken):
            step() if step is not None else self._step(span)
        self.decode_steps += max(n, taken)
        self.span_steps[span] += max(n, taken)
        return max(n, taken)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids, sampling: Sampling | None = None,
                 seeds: list[int] | None = None, progress=None) -> list[tuple[list[int], str]]:
        """(tokens without the stop token, "stop" or "length") for each prompt, in order."""
        if not prompts:
            return []
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        sampling = sampling or Sampling()
        seeds = list(seeds) if seeds is not None else [0] * len(prompts)
        stop_set = set(stop_ids)
        longest = max(len(p) for p in prompts)
        length = -(-(longest + max_new_tokens) // SLOT_GRANULE) * SLOT_GRANULE
        if self._shape is not None and self._shape[0] > length and self._shape[1:] == (max_new_tokens, sampling,
                                                                                       tuple(sorted(stop_set))):
            length = self._shape[0]  # keep the cache (and its graphs) of a longer chunk before
        self._reset(length, max_new_tokens, sampling, sorted(stop_set))

        # pop() takes the longest; a prompt's repeats (its samples) side by side, so that one refill shares its prefill
        queue = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), prompts[i], i))[::-1]
        owner = [-1] * self.batch_size
        filled_in = [-1] * self.batch_size  # the window whose prefill gave the row its current prompt
        row_slot = [0] * self.batch_size  # the host's estimate of `slots` (a busy row's next write)
        row_start = [0] * self.batch_size  # where a busy row's sequence starts (its left padding before)
        answers: list[tuple[list[int], str] | None] = [None] * len(prompts)
        free = list(range(self.batch_size))
        refill_at = max(1, self.batch_size // 64)
        looks: list[Look] = []
        window = 0
        clock = time.perf_counter()

        def lap(part: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            self.host_seconds[part] += now - clock
            clock = now

        while queue or len(free) < self.batch_size:
            if queue and free and (len(free) >= min(refill_at, len(queue)) or len(free) == self.batch_size):
                take = [queue.pop() for _ in range(min(len(free), len(queue)))]  # longest first
                while take:  # a forward of at most prefill_limit tokens (distinct prompts x the longest), one at least
                    budget, n, distinct = max(1, self.prefill_limit // len(prompts[take[0]])), 0, 0
                    while n < len(take) and (distinct < budget or prompts[take[n]] == prompts[take[n - 1]]):
                        distinct += n == 0 or prompts[take[n]] != prompts[take[n - 1]]
                        n += 1
                    group, take = take[:n], take[n:]
                    rows = [free.pop() for _ in group]
                    width = max(len(prompts[i]) for i in group)
                    for row, i in zip(rows, group):
                        owner[row], filled_in[row], row_slot[row], row_start[row] = i, window, width, width - len(prompts[i])
                    with self._timed("prefill"):
                        self._prefill(rows, [prompts[i] for i in group], [seeds[i] for i in group])
                lap("refill")
            # the span holds every busy row's slots through the next steps (graph warm-up: 2 at least); ragged steps
            # read each row's own slots of the whole cache
            span = self.length if self.ragged else attention_span(
                max(row_slot[r] for r in range(self.batch_size) if owner[r] >= 0) + max(self.sync_every, 2), self.length)
            with self._timed("decode"):
                taken = self._steps(self.sync_every, span)
            for row in range(self.batch_size):
                if owner[row] >= 0:
                    self.busy_row_steps += taken
                    self.filled_slot_steps += taken * (row_slot[row] - row_start[row])
                    row_slot[row] = min(row_slot[row] + taken, self.length - 1)
            looks.append(Look(self, window))
            window += 1
            lap("launch")
            # the host reads the window before this one while the device decodes this one (on CUDA the copies
            # are asynchronous); with no prompt left to refill, the oldest window it holds
            if len(looks) > 1 or not queue:
                look = looks.pop(0)
                waited = time.perf_counter()
                finished, lengths = look.read()
                self.host_wait_seconds += time.perf_counter() - waited
                clock = time.perf_counter()
                done = [row for row in finished if owner[row] >= 0 and filled_in[row] <= look.window]
                if not done:
                    lap("look")
                    continue
                done_rows = on_device(done, self.device)
                self.slots.index_fill_(0, done_rows, 0)  # a free row attends from slot 0 (never an empty mask)
                self.starts.index_fill_(0, done_rows, 0)
                for row in done:
                    tokens = look.out[row, : lengths[row]].tolist()
                    if tokens and tokens[-1] in stop_set:
                        answers[owner[row]] = (tokens[:-1], "stop")
                    else:
                        answers[owner[row]] = (tokens, "length")
                    owner[row] = -1
                    free.append(row)
                if progress is not None:
                    progress(len(done))
                lap("look")
        self.prefill_seconds += self._device_seconds("prefill")
        self.decode_seconds += self._device_seconds("decode")
        return answers

    def _device_seconds(self, part: str) -> float:
        """The device time `_timed(part)` recorded since the last reading (waits for the last of its events)."""
        events = self._events[part]
        if events:
            events[-1][1].synchronize()
        seconds = sum(start.elapsed_time(end) for start, end in events) / 1e3
        events.clear()
        return seconds

    @contextmanager
    def _timed(self, part: str):
        """On CUDA, the device time of the work queued within the block, read by `_device_seconds(part)` once all
        steps ran (events: the host does not wait)."""
        if self.device.type != "cuda":
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._events[part].append((start, end))
