"""The decoding engine of the offline benchmark: N requests in flight (N = 1 at batch 1), each row taking the next prompt as
soon as its answer ends (refill), target-only greedy and speculative decoding alike.

`serve` decodes N rows over one static KV cache per model (`BatchKV` of draftsmith.decoding.batch_kv, one row per
request), with the stopping rule and the `Trace` of the eager reference loops (draftsmith.decoding.reference), so a
row's output is comparable token for token with the reference's.

Layout: a request's prompt is left-padded into its row (`starts`: the slot where it begins) to the width of the
prompts admitted with it (a prefill of those rows alone, while the other rows keep their state). Each row has its own
write slot (`lengths`), its own position ids (slot - start) and its own mask (`row_mask`: its slots from its start up
to the query's own), so a refilled row attends to nothing of its previous request: those entries lie past its write
slot (overwritten before any query reaches them) or before its start. A target step reads the cache's first `span`
slots only (`attention_span`: the furthest row's need, rounded up to SPAN_GRANULE): SDPA with a mask reads every slot
it is given, and on one H100 SmolLM2's 4-token verification over 768 slots cost 0.53 ms more than a one-token step,
0.31 ms more over 256 (docs/BENCHMARKS.md).

Round (temperature 0): the proposer drafts per row (EAGLE-3: one draft forward over all rows per chain step; prompt
lookup: an n-gram lookup per row, the drafts padded to the longest row's count; none: target-only greedy, one token a
round); the target verifies every row's [last token, drafts] in one forward; each row accepts its own longest prefix
of drafts equal to the target's argmax, plus the target's token after it (the bonus token), and advances its write
slot by that count. A row's rejected slots are not cleared: the row's next round writes over them, and until then no
query of the row attends to them. Drafts padded beyond a row's own proposal are never accepted. A row with no
request (its answer ended, no prompt left) stays in the forward, adds nothing and its write slot stays.

The target's attention is `grouped_sdpa` (grouped-query KV heads handed to SDPA unrepeated).

CUDA graphs (`cuda_graphs`): each model keeps one cache, write slots and starts per row count (`reserve`), so a round's
step of a shape (rows, tokens, span) is captured once (`capture`, before the timed runs) and replayed. A step reads the
rows' slots from device buffers and writes nothing but the KV cache at them, so it can be replayed (and its capture's
warm-up runs repeated); the host advances the slots after it and checks the cache's bounds against its own copy of
them. A prefill is padded to its width's bucket and replayed per (rows, width); on a CPU everything runs eagerly, where
the tests check the same code. The proposers for rows in flight (prompt lookup, EAGLE-3, the hybrid) are
draftsmith.decoding.engine_proposers; `NoDrafts` here is target-only greedy.

Timing, as a server's client sees it: the run's wall time is shared by its requests (`seconds`: wall time over the
requests, so a method's summed seconds are the run's wall time and its tokens/s the throughput); per request, the time
from its admission to its first token (`ttft_seconds`) and the time per output token after it (`tpot_seconds`).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import torch

from draftsmith.decoding.batch_kv import (
    BatchKV,
    attention_configs,
    grouped_attention,
    left_padded,
    on_device,
    prefill_layout,
    right_padded,
    row_mask,
)
from draftsmith.decoding.static_cache import SPAN_GRANULE, StepGraphs, attention_span, prompt_bucket, prompt_buckets
from draftsmith.decoding.target import TargetModel
from draftsmith.decoding.trace import Trace, answer_done, cut_output, synchronize

CACHE_GRANULE = 256  # cache slots a row, rounded up to this: batches of similar prompts share one cache
PREFILL_GRAPH_WIDTH = 1024  # prefills (padded to a power of two) up to this many tokens a row are captured per shape


def serve_length(prompts: list[list[int]], max_new_tokens: int, k: int) -> int:
    """The slots a row of `serve` needs: the longest prompt's padded width, the answer, and the last rounds past it."""
    return prompt_bucket(max(len(p) for p in prompts)) + max_new_tokens + 3 * (k + 1)


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
    latter."""

    def __init__(self, rows: int, length: int, device):
        self.cache = BatchKV(rows, -(-length // CACHE_GRANULE) * CACHE_GRANULE)
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.host_lengths = [0] * rows

    def clear(self) -> None:
        """Every row without a request: starting at slot 0, its next free slot 0."""
        self.starts.zero_()
        self.lengths.zero_()
        self.host_lengths = [0] * len(self.host_lengths)

    def admit(self, rows: list[int], starts: torch.Tensor, length: int) -> None:
        """`rows` hold new requests from slot `starts[i]` on, their next free slot `length`."""
        index = on_device(rows, self.starts.device)
        self.starts[index] = starts
        self.lengths.index_fill_(0, index, length)
        for row in rows:
            self.host_lengths[row] = length

    def advance(self, counts: list[int]) -> None:
        """Each row's next free slot `counts[row]` further on."""
        self.host_lengths = [n + c for n, c in zip(self.host_lengths, counts)]
        self.lengths += on_device(counts, self.lengths.device)  # queued, not a blocking copy (on_device)

    def check_width(self, width: int, what: str) -> None:
        """A clear error where a prompt of `width` slots does not fit a row."""
        if width > self.cache.length:
            raise ValueError(f"the {what} batched KV cache holds {self.cache.length} slots a row; a prompt of {width} "
                             "asked for")

    def check(self, ahead: int, what: str) -> None:
        """A clear error where a row would write `ahead` slots past its next free one, beyond the cache."""
        if max(self.host_lengths) + ahead > self.cache.length:
            raise ValueError(f"the {what} batched KV cache holds {self.cache.length} slots a row; "
                             f"{max(self.host_lengths)} + {ahead} asked for")


class RowBufferSet:
    """`RowBuffers` per row count, and the CUDA graphs captured on them (dropped when a cache must grow)."""

    def __init__(self, cuda_graphs: bool, device, tune_kernels: bool = False):
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device (here {device.type})")
        self.graphs = StepGraphs(cuda_graphs, tune=tune_kernels)
        self.device = device
        self.by_rows: dict[int, RowBuffers] = {}

    def reserve(self, rows: int, length: int) -> RowBuffers:
        """The buffers of `rows` rows, with at least `length` slots a row."""
        buffers = self.by_rows.get(rows)
        if buffers is None or buffers.cache.length < length:
            if buffers is not None:
                self.graphs.clear()  # they address the old cache
            self.by_rows[rows] = buffers = RowBuffers(rows, length, self.device)
        return buffers

    def prefill(self, buffers: RowBuffers, key: tuple, step, *inputs: torch.Tensor):
        """`step(*inputs)`, a prefill into `buffers` of inputs [R, W, ...], every value it varies by an input: up to
        PREFILL_GRAPH_WIDTH tokens a row replayed from a capture per (the buffers' row count, *key), eager beyond. The
        row count is in the key because a graph writes the cache it was captured on: a one-row refill at 16 in flight
        replaying batch 1's ran its row index past that one-row cache (a device-side assert on one H100)."""
        if inputs[0].shape[1] > PREFILL_GRAPH_WIDTH:
            return step(*inputs)
        return self.graphs.run(("prefill", buffers.cache.rows, *key), step, *inputs, tune=False)


def captured_prefill_widths(longest_prompt: int | None, length: int) -> list[int]:
    """The padded widths a warm-up captures one row's prefill at: every bucket of a prompt up to `longest_prompt`
    tokens that a cache of `length` slots holds and that is replayed (none without a longest prompt)."""
    return [b for b in prompt_buckets(longest_prompt) if b <= min(PREFILL_GRAPH_WIDTH, length)] if longest_prompt else []


class BatchTarget:
    """The target of a `TargetModel` (its model and auxiliary-layer hooks) decoding B rows over one `BatchKV`; with
    `tune_kernels` each step shape is captured under every kernel setting and replayed with the fastest (`StepGraphs`;
    the spans of one shape share the setting tuned on the first)."""

    MAX_GRAPH_WIDTH = 16  # wider steps (a prompt) run eagerly

    def __init__(self, target: TargetModel, cuda_graphs: bool = False, tune_kernels: bool = False):
        if not target.static:
            raise ValueError("the engine needs a full-attention SDPA target (its masks are built here)")
        self.target = target
        self.device = target.device
        self.buffers = RowBufferSet(cuda_graphs, self.device, tune_kernels=tune_kernels)
        self._attention = attention_configs(target.model)

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
        instead, so that its sequence starts at slot 0 and no step's span reads its padding (the padding's slots lie
        past its write slot, overwritten before any query reaches them). With CUDA graphs the width is the longest's
        bucket (`prompt_bucket`), and a prefill of up to PREFILL_GRAPH_WIDTH is replayed, one capture per (buffers'
        rows, rows, width): a refill of one row costs one launch rather than the model's hundreds. Returns the prompts
        as the rows hold them (`AdmittedPrompts`) and the last prompt position's logits [R, V]."""
        width = prompt_bucket(max(len(p) for p in prompts)) if self.buffers.graphs.enabled else None
        if len(prompts) == 1:
            ids, starts = right_padded(prompts[0], self.device, width)
            last = len(prompts[0]) - 1
        else:
            ids, starts = left_padded(prompts, self.device, width)
            last = ids.shape[1] - 1
        width = ids.shape[1]
        self.rows.check_width(width, "target's")
        index = on_device(rows, self.device)
        step = functools.partial(self._prefill_step, with_aux=with_aux)
        kept = on_device([last], self.device)
        logits, aux = self.buffers.prefill(self.rows, (len(rows), width, with_aux), step, ids, starts, index, kept)
        self.rows.admit(rows, starts, last + 1)
        return AdmittedPrompts(ids, starts, last, aux), logits[:, -1]

    def _prefill_step(self, ids: torch.Tensor, starts: torch.Tensor, index: torch.Tensor, kept: torch.Tensor,
                      with_aux: bool):
        """The prompts `ids` (starting at `starts`) into cache rows `index`, keeping the logits at position `kept`
        [1], on the device alone (what a graph captures)."""
        slots, mask, positions = prefill_layout(starts, ids.shape[1])
        cache = self.rows.cache
        cache.prefill_rows = index
        try:
            with grouped_attention(self._attention):
                return self.target.call(kept, with_aux, input_ids=ids, attention_mask=mask, position_ids=positions,
                                        cache_position=slots, past_key_values=cache)
        finally:
            cache.prefill_rows = None

    def forward(self, input_ids: torch.Tensor, with_aux: bool = False, keep: int | None = None):
        """Run `input_ids` [B, q], row r's at its slots lengths[r]..lengths[r]+q-1 (the caller then advances each
        row by what it keeps: `advance`), attending to the cache's first `span` slots. Returns the last `keep`
        (default q) positions' logits [B, keep, V] and, with `with_aux`, the auxiliary states [B, q, 3H]; a replayed
        step's outputs are overwritten by its next replay."""
        rows, q = input_ids.shape
        self.rows.check(q, "target's")
        span = attention_span(max(self.rows.host_lengths) + q, self.rows.cache.length)
        keep = keep or q
        step = functools.partial(self._step, keep=keep, with_aux=with_aux, span=span)
        if q > self.MAX_GRAPH_WIDTH:
            return step(input_ids)
        return self.buffers.graphs.run((rows, q, keep, with_aux, span), step, input_ids, family=(rows, q, keep, with_aux))

    def advance(self, counts: list[int]) -> None:
        """Each row's write slot `counts[row]` on (what it kept of the last forward)."""
        self.rows.advance(counts)

    def _step(self, input_ids: torch.Tensor, keep: int, with_aux: bool, span: int):
        rows = self.rows
        slots = rows.lengths[:, None] + torch.arange(input_ids.shape[1], device=self.device)
        rows.cache.write_slots, rows.cache.span = slots, span
        try:
            with grouped_attention(self._attention):  # the regenerate decoder's attention: KV heads not repeated
                return self.target.call(keep, with_aux, input_ids=input_ids,
                                        attention_mask=row_mask(slots, rows.starts, span),
                                        position_ids=(slots - rows.starts[:, None]).clamp(min=0),
                                        cache_position=slots[0], past_key_values=rows.cache)
        finally:
            rows.cache.write_slots, rows.cache.span = None, rows.cache.length

    @torch.inference_mode()  # as the decoding loops: a graph's static inputs are inference tensors
    def capture(self, rows: int, k: int, longest_prompt: int | None = None) -> None:
        """Capture now every step a decode of `rows` rows with up to k drafts takes (1..k+1 tokens at every span; with
        and without the auxiliary states) and, given the longest prompt, one row's prefill at every bucket up to its
        (a refill's, or each prompt's at batch 1), so that none is captured inside a timed decode. Reserve the buffers
        first."""
        if not self.buffers.graphs.enabled:
            return
        aux = {False, bool(self.target.aux_layer_ids)}
        everyone, length = list(range(rows)), self.rows.cache.length
        for span in range(SPAN_GRANULE, length + SPAN_GRANULE, SPAN_GRANULE):
            for q in range(1, k + 2):
                self.rows.admit(everyone, torch.zeros(rows, dtype=torch.long, device=self.device),
                                min(span, length) - q)  # the furthest row's need: the span's last q slots
                for with_aux in aux:
                    self.forward(torch.zeros((rows, q), dtype=torch.long, device=self.device), with_aux=with_aux)
        for bucket in captured_prefill_widths(longest_prompt, length):
            for with_aux in aux:
                self.prefill([0], [[0] * bucket], with_aux=with_aux)
        self.rows.clear()


class NoDrafts:
    """Target-only greedy decoding as a proposer: no drafts, so each round verifies the last token alone."""

    needs_aux = False

    def __init__(self, device):
        self.device = device

    def begin(self, rows: int, length: int) -> None:
        pass

    def prefill(self, rows: list[int], prompts: AdmittedPrompts, first: torch.Tensor) -> None:
        pass

    def propose(self, contexts: list[list[int]], k: int) -> tuple[torch.Tensor, list[int]]:
        return torch.zeros((len(contexts), 0), dtype=torch.long, device=self.device), [0] * len(contexts)

    def accept(self, next_tokens, aux, counts) -> None:
        pass


@torch.inference_mode()
def serve(target: BatchTarget, proposer, prompts: list[list[int]], concurrency: int, k: int, max_new_tokens: int,
          stop_ids: set[int]) -> list[Trace]:
    """Greedy decoding of every prompt with `concurrency` requests in flight, in order, a row taking the next prompt
    as soon as its answer ends: speculative with `proposer` (NoDrafts: target-only) and up to k drafts a round."""
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    device = target.device
    rows = min(concurrency, len(prompts))
    length = serve_length(prompts, max_new_tokens, k)
    target.begin(rows, length)
    proposer.begin(rows, length)
    queue = list(range(len(prompts)))
    owner = [-1] * rows  # each row's request (-1: none)
    contexts: list[list[int]] = [[] for _ in range(rows)]  # host copies for n-gram lookup
    traces: list[Trace | None] = [None] * len(prompts)
    admitted, finished = [0.0] * len(prompts), [0.0] * len(prompts)
    last = torch.zeros(rows, dtype=torch.long, device=device)
    drafting = not isinstance(proposer, NoDrafts)
    synchronize(device)
    start = time.perf_counter()

    def refill(free: list[int], at: float) -> None:
        """The next prompts into the `free` rows, which came free at time `at` (a client in a closed loop sends its
        next request as its last answer ends): their time to first token counts from then."""
        while free and queue:
            take = [queue.pop(0) for _ in range(min(len(free), len(queue)))]
            used, free[:] = free[: len(take)], free[len(take):]
            admitted_prompts, logits = target.prefill(used, [prompts[i] for i in take], with_aux=proposer.needs_aux)
            first = logits.argmax(-1)
            last[on_device(used, device)] = first
            proposer.prefill(used, admitted_prompts, first)
            now = time.perf_counter()
            for row, i, token in zip(used, take, first.tolist()):
                admitted[i] = at
                traces[i] = Trace(tokens=[token], target_forwards=1, first_token_seconds=now - at, ttft_seconds=now - at)
                owner[row], contexts[row] = i, list(prompts[i]) + [token]
                if answer_done(traces[i].tokens, traces[i].tokens, max_new_tokens, stop_ids):
                    finished[i], owner[row] = now, -1
                    free.append(row)
            at = now

    refill(list(range(rows)), start)
    while any(o >= 0 for o in owner):
        draft, proposed = proposer.propose(contexts, k)
        m = draft.shape[1]
        inputs = torch.cat([last[:, None], draft], dim=1) if m else last[:, None]
        logits, aux = target.forward(inputs, with_aux=proposer.needs_aux)
        verified = logits.argmax(-1)  # [B, m + 1]: the target's token after each input position
        both = (torch.cat([draft, verified], dim=1) if m else verified).tolist()  # the round's one host sync
        drafted, target_tokens = [b[:m] for b in both], [b[m:] for b in both]
        now = time.perf_counter()
        counts, free = [], []
        for row, i in enumerate(owner):
            if i < 0:
                counts.append(0)
                continue
            trace, accepted = traces[i], 0
            while accepted < proposed[row] and drafted[row][accepted] == target_tokens[row][accepted]:
                accepted += 1
            new = target_tokens[row][: accepted + 1]
            if drafting:  # target-only greedy has no rounds of drafts
                trace.proposed.append(proposed[row])
                trace.accepted.append(accepted)
            trace.target_forwards += 1
            trace.tokens += new
            contexts[row] += new
            counts.append(accepted + 1)
            if answer_done(trace.tokens, new, max_new_tokens, stop_ids):
                finished[i], owner[row] = now, -1
                free.append(row)
        proposer.accept(verified, aux, counts)
        target.advance(counts)  # everything a row verified but its bonus token, which the next round feeds
        # the bonus tokens from the host's copy: one queued copy rather than a round of indexing kernels
        last = on_device([tokens[c - 1] if c else 0 for tokens, c in zip(target_tokens, counts)], device)
        for row in free:
            contexts[row] = []
        refill(free, now)
    synchronize(device)
    wall = time.perf_counter() - start
    for i, trace in enumerate(traces):
        trace.tokens = cut_output(trace.tokens, max_new_tokens, stop_ids)
        trace.seconds = wall / len(traces)  # the requests share the run's wall time: summed, its throughput
        after_first = finished[i] - admitted[i] - trace.ttft_seconds
        trace.tpot_seconds = after_first / (len(trace.tokens) - 1) if len(trace.tokens) > 1 else None
    return traces
