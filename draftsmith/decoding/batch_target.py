"""The target of the decoding engine (draftsmith.decoding.engine.serve) running B rows at once: `BatchTarget` (a
prompt prefill into some rows, a verification of every row's tokens, target-only decode steps on the device alone)
over `RowBuffers` (one model's static KV cache, `BatchKV`, and each row's slots and decode state), and the CUDA graphs
captured on them.

Layout: a request's prompt is left-padded into its row (`starts`: the slot where it begins) to the width of the
prompts admitted with it (a prefill of those rows alone, while the other rows keep their state). Each row has its own
write slot (`lengths`), its own position ids (slot - start) and its own mask (`row_mask`: its slots from its start up
to the query's own), so a refilled row attends to nothing of its previous request: those entries lie past its write
slot (overwritten before any query reaches them) or before its start. A row without a request sits at slot 0.

The target's attention is `grouped_sdpa` (grouped-query KV heads handed to SDPA unrepeated) over the whole cache
through the rows' masks, or for every step but a prefill with `ragged` the Triton kernel that reads each row's own
slots (no mask).

CUDA graphs (`cuda_graphs`): each model keeps one cache, write slots and starts per row count (`reserve`), so a round's
step of a shape (rows, tokens) is captured once (`capture`, before the timed runs) and replayed. A verification
step reads the rows' slots from device buffers and writes nothing but the KV cache at them, so it can be replayed (and
its capture's warm-up runs repeated); the host advances the slots after it and checks the cache's bounds against its
own copy of them. A decode step advances its rows itself, so the steps its capture runs count (`decode` returns them).
A prefill is padded to its width's bucket and replayed per (rows, width); on a CPU everything runs eagerly, where the
tests check the same code.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import NamedTuple

import torch

from draftsmith.decoding.batch_kv import (
    GROUPED_SDPA,
    RAGGED,
    BatchKV,
    attention_configs,
    grouped_attention,
    on_device,
    prefill_layout,
    ragged_bounds,
    row_mask,
)
from draftsmith.decoding.ragged_attention import require_ragged
from draftsmith.decoding.sampling import Sampling, choose_tokens
from draftsmith.decoding.static_cache import CapturedStep, StepGraphs, prompt_bucket
from draftsmith.decoding.target import TargetModel

log = logging.getLogger(__name__)

CACHE_GRANULE = 64  # cache slots a row, rounded up to this: batches of similar prompts share one cache
PREFILL_GRAPH_WIDTH = 1024  # prefills (padded to a power of two) up to this many tokens a row are captured per shape
MAX_ROUND_STEPS = 64  # decode steps a round of target-only decoding takes at most
MAX_STOP_IDS = 16  # stop tokens a decode step checks on the device
# tokens (distinct prompts x the longest) one prefill forward takes at most: its mask grows with rows x width^2, and a
# refill of 2,048 rows of 1,024-token prompts in one forward would need ~60 GB for the mask alone
PREFILL_LIMIT = 32768


class AdmittedPrompts(NamedTuple):
    """A prefill's prompts as their rows hold them: `ids` [R, W] (padded; with CUDA graphs W is a bucket), each row's
    first slot `starts` [R], the slot of the prompts' last position `last` (W - 1 where left-padded; a request alone is
    padded on the right) and, where asked for, the target's auxiliary states `aux` [R, W, 3H] (a replay's outputs: use
    them before the next step)."""

    ids: torch.Tensor
    starts: torch.Tensor
    last: int
    aux: torch.Tensor | None


class RowBuffers:
    """One model's decoding buffers for batches of `rows` rows, reused batch after batch (captured steps address
    them): the KV cache, each row's first slot (`starts`) and next free slot (`lengths`), and the host's copy of the
    latter. For target-only decoding (`BatchTarget.decode`) also each row's next input (`tokens`), its seed, the
    tokens its request has (`generated`: the sampler's index of the next), whether it decodes (`active`: it holds a
    request whose answer has not ended at a stop token or the token limit, `stop_at`), and the tokens of a round by
    step (`out`, written at column `step`)."""

    def __init__(self, rows: int, length: int, device):
        self.cache = BatchKV(rows, -(-length // CACHE_GRANULE) * CACHE_GRANULE)
        self.starts, self.lengths, self.tokens, self.seeds, self.generated = (
            torch.zeros(rows, dtype=torch.long, device=device) for _ in range(5))
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stops = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, device=device)
        self.limit, self.step = (torch.zeros(1, dtype=torch.long, device=device) for _ in range(2))
        self.out = torch.zeros((rows, MAX_ROUND_STEPS + CapturedStep.WARM_UP_RUNS + 1), dtype=torch.long, device=device)
        self.host_lengths, self.host_starts, self.host_active = [0] * rows, [0] * rows, [False] * rows
        self._looks = [torch.empty(self.out.shape, dtype=torch.long, pin_memory=self.out.is_cuda) for _ in range(2)]

    def clear(self) -> None:
        """Every row without a request: starting at slot 0, its next free slot 0."""
        for buffer in (self.starts, self.lengths, self.tokens, self.seeds, self.generated, self.active):
            buffer.zero_()
        rows = len(self.host_lengths)
        self.host_lengths, self.host_starts, self.host_active = [0] * rows, [0] * rows, [False] * rows

    def admit(self, rows: list[int], starts: torch.Tensor, length: int, host_starts: list[int] | None = None) -> None:
        """`rows` hold new requests from slot `starts[i]` on (where given, the host's copy `host_starts`: for the
        counts of filled slots), their next free slot `length`."""
        index = on_device(rows, self.starts.device)
        self.starts[index] = starts
        self.lengths.index_fill_(0, index, length)
        for row, start in zip(rows, host_starts or [0] * len(rows)):
            self.host_lengths[row], self.host_starts[row] = length, start

    def stop_at(self, stop_ids, max_new_tokens: int) -> None:
        """The end of every answer that a decode step sees on the device: a token of `stop_ids`, or the
        `max_new_tokens`-th token; the row stops decoding there (serve cuts its answer by the same rule)."""
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}")
        self.stops.fill_(-1)
        self.stops[: len(stop_ids)] = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self.limit.fill_(max_new_tokens)

    def begin_decoding(self, rows: list[int], first: torch.Tensor, seeds: torch.Tensor) -> None:
        """`rows` decode on from their first tokens `first`, sampled with `seeds`."""
        index = on_device(rows, self.starts.device)
        self.tokens[index], self.seeds[index] = first, seeds
        self.generated.index_fill_(0, index, 1)
        self.active.index_fill_(0, index, True)
        for row in rows:
            self.host_active[row] = True

    def release(self, rows: list[int]) -> None:
        """`rows` hold no request: each writes and reads slot 0 alone (so its mask is never empty: an empty one gives
        NaN, which a masked slot still spreads, 0 * NaN) and a decode step leaves it there."""
        if not rows:
            return
        index = on_device(rows, self.starts.device)
        for buffer in (self.starts, self.lengths, self.active):
            buffer.index_fill_(0, index, 0)
        for row in rows:
            self.host_lengths[row], self.host_starts[row], self.host_active[row] = 0, 0, False

    def advance(self, counts: list[int]) -> None:
        """Each row's next free slot `counts[row]` further on."""
        self.host_lengths = [n + c for n, c in zip(self.host_lengths, counts)]
        self.lengths += on_device(counts, self.lengths.device)  # queued, not a blocking copy (on_device)

    def look(self, columns: int):
        """`out` copied to the host (asynchronously on CUDA, into one of two pinned buffers: whole, as an asynchronous
        copy needs a contiguous target); call the result for its first `columns` as lists (waiting for the copy)."""
        host = self._looks[0]
        self._looks.reverse()
        host.copy_(self.out, non_blocking=True)  # on a CPU a plain copy
        event = torch.cuda.Event() if self.out.is_cuda else None
        if event is not None:
            event.record()

        def read() -> list[list[int]]:
            if event is not None:
                event.synchronize()
            return host[:, :columns].tolist()

        return read

    def check(self, ahead: int, what: str) -> None:
        """A clear error where a row would write `ahead` slots past its next free one, beyond the cache."""
        if max(self.host_lengths) + ahead > self.cache.length:
            raise ValueError(f"the {what} batched KV cache holds {self.cache.length} slots a row; "
                             f"{max(self.host_lengths)} + {ahead} asked for")


class RowBufferSet:
    """`RowBuffers` per row count, and the CUDA graphs captured on them (dropped when a cache must grow). It refuses,
    at construction, steps that cannot run on `device`: attention through the ragged kernel, CUDA graphs."""

    def __init__(self, cuda_graphs: bool, device, capture_prefills: bool = True, ragged: bool = False):
        if ragged:
            require_ragged(device)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device (here {device.type})")
        self.graphs = StepGraphs(cuda_graphs)
        self.device = device
        self.capture_prefills = capture_prefills
        self.by_rows: dict[int, RowBuffers] = {}

    def reserve(self, rows: int, length: int) -> RowBuffers:
        """The buffers of `rows` rows, with at least `length` slots a row."""
        buffers = self.by_rows.get(rows)
        if buffers is None or buffers.cache.length < length:
            if buffers is not None:
                self.graphs.steps.clear()  # they address the old cache
            self.by_rows[rows] = buffers = RowBuffers(rows, length, self.device)
        return buffers

    def prefill(self, buffers: RowBuffers, key: tuple, step, *inputs: torch.Tensor):
        """`step(*inputs)`, a prefill into `buffers` of inputs [R, W, ...], every value it varies by an input: up to
        PREFILL_GRAPH_WIDTH tokens a row replayed from a capture per (the buffers' row count, *key), eager beyond. The
        row count is in the key because a graph writes the cache it was captured on: a one-row refill at 16 in flight
        replaying batch 1's ran its row index past that one-row cache (a device-side assert on one H100)."""
        if inputs[0].shape[1] > PREFILL_GRAPH_WIDTH or not self.capture_prefills:
            return step(*inputs)
        return self.graphs.run(("prefill", buffers.cache.rows, *key), step, *inputs)


def captured_prefill_widths(longest_prompt: int | None, length: int) -> list[int]:
    """The padded widths a warm-up captures one row's prefill at: every bucket of a prompt up to `longest_prompt`
    tokens that a cache of `length` slots holds and that is replayed (none without a longest prompt)."""
    buckets = {prompt_bucket(n) for n in range(1, (longest_prompt or 0) + 1)}
    return sorted(b for b in buckets if b <= min(PREFILL_GRAPH_WIDTH, length))


class BatchTarget:
    """The target of a `TargetModel` (its model and auxiliary-layer hooks) decoding B rows over one `BatchKV`.
    With `ragged` its decode and verification steps attend to each row's own slots (draftsmith.decoding.
    ragged_attention, a Triton kernel) rather than to the whole cache through a mask. `compile_sampler` hands a decode
    step's token choice to torch.compile (fused kernels: each bisection step of the nucleus reads the vocabulary once
    instead of three times); `capture_prefills` False runs every prefill eagerly at the prompts' own width
    (regenerate: a refill of many rows of any width, whose shapes a graph each would not pay back). `prefill_limit`:
    the tokens one prefill forward takes at most (`serve`)."""

    MAX_GRAPH_WIDTH = 16  # wider steps (a prompt) run eagerly

    def __init__(self, target: TargetModel, cuda_graphs: bool = False, ragged: bool = False,
                 compile_sampler: bool = False, capture_prefills: bool = True, prefill_limit: int = PREFILL_LIMIT):
        if not target.static:
            raise ValueError("the engine needs a full-attention SDPA target (its masks are built here)")
        if prefill_limit < 1:
            raise ValueError(f"prefill_limit must be >= 1, got {prefill_limit}")
        self.target = target
        self.device = target.device
        self.buffers = RowBufferSet(cuda_graphs, self.device, capture_prefills=capture_prefills, ragged=ragged)
        self.ragged, self.prefill_limit = ragged, prefill_limit
        self._choose_fn = torch.compile(choose_tokens, dynamic=False) if compile_sampler else choose_tokens
        self._attention = attention_configs(target.model)
        # running counts, for throughput reports (the difference of two readings covers the calls between): decode
        # steps, the rows busy in them and the slots their sequences filled, prefilled tokens
        self.stats: Counter = Counter()

    @property
    def bucketed_prefills(self) -> bool:
        """Whether prompts are padded to their bucket (`prompt_bucket`): where prefills are captured as graphs."""
        return self.buffers.graphs.enabled and self.buffers.capture_prefills

    def reserve(self, rows: int, length: int) -> None:
        """Buffers for `rows` rows of at least `length` slots (the prompt's width and what follows it), so that the
        batches' `start` finds them and the steps captured on them stay."""
        self.rows = self.buffers.reserve(rows, length)

    def begin(self, rows: int, length: int) -> None:
        """`rows` rows of at least `length` slots, none holding a request yet."""
        self.reserve(rows, length)
        self.rows.clear()

    def prefill(self, rows: list[int], prompts: list[list[int]], with_aux: bool = False):
        """New requests in `rows` (the others keep theirs): the prompts, left-padded to the longest, run over those rows
        alone, each attending to itself; a request alone (batch 1, or a refill of one row) is padded on the right
        instead, so that its sequence starts at slot 0 (the padding's slots lie past its write slot, overwritten before
        any query reaches them). With CUDA graphs the width is the longest's bucket (`prompt_bucket`), and a prefill of
        up to PREFILL_GRAPH_WIDTH is replayed, one capture per (buffers' rows, rows, width): a refill of one row costs
        one launch rather than the model's hundreds. A prompt that several rows take (samples of one prompt) runs
        once, into its first row, whose cache the others copy. Returns the prompts as the rows hold them
        (`AdmittedPrompts`) and the last prompt position's logits [R, V]."""
        distinct: dict[tuple, int] = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        if len(distinct) < len(prompts):
            lead = [rows[which.index(k)] for k in range(len(distinct))]  # each distinct prompt's first row
            admitted, logits = self._prefill(lead, [list(p) for p in distinct], with_aux)
            followers = [(lead[k], row) for row, k in zip(rows, which) if lead[k] != row]
            self.rows.cache.copy_rows(*on_device(followers, self.device).T, admitted.ids.shape[1])
            pick = on_device(which, self.device)
            host_starts = [self.rows.host_starts[lead[k]] for k in which]
            self.rows.admit(rows, admitted.starts[pick], admitted.last + 1, host_starts)
            aux = admitted.aux[pick] if admitted.aux is not None else None
            return AdmittedPrompts(admitted.ids[pick], admitted.starts[pick], admitted.last, aux), logits[pick]
        return self._prefill(rows, prompts, with_aux)

    def _prefill(self, rows: list[int], prompts: list[list[int]], with_aux: bool):
        longest = max(len(p) for p in prompts)
        width = prompt_bucket(longest) if self.bucketed_prefills else longest
        if width > self.rows.cache.length:
            raise ValueError(f"the target's batched KV cache holds {self.rows.cache.length} slots a row; a prompt of "
                             f"{width} asked for")
        host_starts = [0] if len(prompts) == 1 else [width - len(p) for p in prompts]  # one alone: padded on the right
        padded = [[0] * s + list(p) + [0] * (width - s - len(p)) for s, p in zip(host_starts, prompts)]
        ids, starts = on_device(padded, self.device), on_device(host_starts, self.device)
        last = host_starts[0] + len(prompts[0]) - 1  # the slot of the prompts' last position
        self.stats["prefill_tokens"] += ids.numel()
        index = on_device(rows, self.device)
        step = functools.partial(self._prefill_step, with_aux=with_aux)
        kept = on_device([last], self.device)
        logits, aux = self.buffers.prefill(self.rows, (len(rows), width, with_aux), step, ids, starts, index, kept)
        self.rows.admit(rows, starts, last + 1, host_starts)
        return AdmittedPrompts(ids, starts, last, aux), logits[:, -1]

    def _prefill_step(self, ids: torch.Tensor, starts: torch.Tensor, index: torch.Tensor, kept: torch.Tensor,
                      with_aux: bool):
        """The prompts `ids` (starting at `starts`) into cache rows `index`, keeping the logits at position `kept`
        [1], on the device alone (what a graph captures)."""
        slots, mask, positions = prefill_layout(starts, ids.shape[1])
        with self.rows.cache.writing(prefill_rows=index) as cache, grouped_attention(self._attention):
            return self.target.call(kept, with_aux, input_ids=ids, attention_mask=mask, position_ids=positions,
                                    cache_position=slots, past_key_values=cache)

    def first_tokens(self, rows: list[int], logits: torch.Tensor, sampling: Sampling, seeds: list[int]) -> torch.Tensor:
        """The first token [R] of each of `rows`' new requests, chosen from its prompt's last logits (the draw of its
        token 0 with its seed); the rows' decode state (`RowBuffers.begin_decoding`) starts from it."""
        row_seeds = on_device(seeds, self.device)
        first = choose_tokens(logits, sampling, row_seeds, torch.zeros_like(row_seeds))
        self.rows.begin_decoding(rows, first, row_seeds)
        return first

    def decode(self, steps: int, sampling: Sampling) -> int:
        """`steps` decode steps of every row, each taking the token the step before chose, on the device alone; the
        round's tokens land in `rows.out` (column 0: each row's input to the round, then one column a step). Returns
        the steps that ran: a step's first capture as a CUDA graph runs it WARM_UP_RUNS times more (for real). A row
        whose answer ended stops advancing on the device (`RowBuffers.stop_at`) while the host, reading a round late,
        still counts it on: the host's copy stops at the cache's last slot, which a row with a request never reaches
        (serve_length), and so does the device's, as a guard."""
        rows = self.rows
        busy = [r for r, on in enumerate(rows.host_active) if on]
        key = ("decode", rows.cache.rows, sampling)
        ran = steps + self.buffers.graphs.first_call_runs(key)
        rows.out[:, 0] = rows.tokens
        rows.step.fill_(1)
        step = functools.partial(self._decode_step, sampling=sampling)
        for _ in range(steps):
            self.buffers.graphs.run(key, step)
        self.stats["decode_steps"] += ran
        self.stats["busy_row_steps"] += ran * len(busy)
        self.stats["filled_slot_steps"] += ran * sum(rows.host_lengths[r] - rows.host_starts[r] for r in busy)
        for r in busy:
            rows.host_lengths[r] = min(rows.host_lengths[r] + ran, rows.cache.length - 1)
        return ran

    def _decode_step(self, sampling: Sampling) -> None:
        """One token for every row (what a graph captures); a row without a request (`RowBuffers.release`) stays at
        slot 0."""
        rows = self.rows
        logits, _ = self._step(rows.tokens[:, None], False)
        chosen = self._choose(logits[:, -1], sampling, rows.seeds, rows.generated)
        rows.out.index_copy_(1, rows.step, chosen[:, None])
        rows.step += 1
        rows.tokens.copy_(chosen)
        rows.generated += 1
        rows.lengths.copy_((rows.lengths + rows.active).clamp(max=rows.cache.length - 1))
        ended = (chosen[:, None] == rows.stops).any(-1) | (rows.generated >= rows.limit)
        rows.active.logical_and_(~ended)  # an ended row reads and writes its one slot, as a free row does

    def _choose(self, logits, sampling, seeds, steps) -> torch.Tensor:
        try:
            return self._choose_fn(logits, sampling, seeds, steps)
        except Exception as err:  # a compiler that fails does so on the first (eager, uncaptured) step
            if self._choose_fn is choose_tokens:
                raise
            log.warning("torch.compile of the token choice failed (%s: %s); choosing eagerly", type(err).__name__, err)
            self._choose_fn = choose_tokens
            return choose_tokens(logits, sampling, seeds, steps)

    def forward(self, input_ids: torch.Tensor, with_aux: bool = False):
        """Run `input_ids` [B, q], row r's at its slots lengths[r]..lengths[r]+q-1 (the caller then advances each
        row by what it keeps: `advance`), each attending to its row's slots up to its own. Returns the logits [B, q, V]
        and, with `with_aux`, the auxiliary states [B, q, 3H]; a replayed step's outputs are overwritten by its next
        replay."""
        rows, q = input_ids.shape
        self.rows.check(q, "target's")
        step = functools.partial(self._step, with_aux=with_aux)
        if q > self.MAX_GRAPH_WIDTH:
            return step(input_ids)
        return self.buffers.graphs.run((rows, q, with_aux), step, input_ids)

    def advance(self, counts: list[int]) -> None:
        """Each row's write slot `counts[row]` on (what it kept of the last forward)."""
        self.rows.advance(counts)

    def _step(self, input_ids: torch.Tensor, with_aux: bool):
        """`input_ids` [B, q] at each row's next slots, attending to the whole cache through the rows' masks, or
        (`ragged`) the Triton kernel over each row's own slots, its first slot and the first query's passed for a
        mask."""
        rows = self.rows
        slots = rows.lengths[:, None] + torch.arange(input_ids.shape[1], device=self.device)
        if self.ragged:  # a row that does not decode reads its own slots alone
            first = torch.where(rows.active, rows.starts, rows.lengths)
            mask, attention = ragged_bounds(first, rows.lengths), RAGGED
        else:
            mask, attention = row_mask(slots, rows.starts, rows.cache.length), GROUPED_SDPA
        with rows.cache.writing(write_slots=slots) as cache, grouped_attention(self._attention, attention):
            return self.target.call(input_ids.shape[1], with_aux, input_ids=input_ids, attention_mask=mask,
                                    position_ids=(slots - rows.starts[:, None]).clamp(min=0),
                                    cache_position=slots[0], past_key_values=cache)

    @torch.inference_mode()  # as the decoding loops: a graph's static inputs are inference tensors
    def capture(self, rows: int, k: int, longest_prompt: int | None = None) -> None:
        """Capture now every step a decode of `rows` rows with up to k drafts takes (1..k+1 tokens, with and without
        the auxiliary states; target-only greedy's decode step) and, given the longest prompt, one row's prefill at
        every bucket up to its (a refill's, or each prompt's at batch 1), so that none is captured inside a timed
        decode. Reserve the buffers first."""
        if not self.buffers.graphs.enabled:
            return
        aux = {False, bool(self.target.aux_layer_ids)}
        everyone, length = list(range(rows)), self.rows.cache.length
        zeros = torch.zeros(rows, dtype=torch.long, device=self.device)
        for q in range(1, k + 2):
            self.rows.admit(everyone, zeros, length - q)  # each row's last q slots
            for with_aux in aux:
                self.forward(torch.zeros((rows, q), dtype=torch.long, device=self.device), with_aux=with_aux)
        # target-only greedy's decode step, its warm-up runs and its replay ending at the cache's last slot
        self.rows.admit(everyone, zeros, length - 1 - CapturedStep.WARM_UP_RUNS)
        self.rows.begin_decoding(everyone, zeros, zeros)
        self.decode(1, Sampling())
        for bucket in captured_prefill_widths(longest_prompt, length):
            for with_aux in aux:
                self.prefill([0], [[0] * bucket], with_aux=with_aux)
        self.rows.clear()
