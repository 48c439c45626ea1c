"""Batched greedy and speculative decoding for the offline benchmark: B prompts decoded side by side.

The batch-1 loops (draftsmith.benchmark.spec_decode) decode one prompt at a time; these decode B prompts over one
static KV cache per model (`BatchKV` of draftsmith.decoding.batch, one row per prompt), with the same stopping rule
and the same `Trace` per prompt, so a row's output is comparable token for token with its batch-1 output.

Layout: each prompt is left-padded into its row (`starts`: the slot where it begins), so every row's first generated
token is chosen at the same slot. Each row has its own write slot (`lengths`), its own position ids (slot - start)
and its own mask (`row_mask`: its slots from its start up to the query's own).

Speculative round (temperature 0): the proposer drafts per row (EAGLE-3: one draft forward over all rows per chain
step; prompt lookup: an n-gram lookup per row, the drafts padded to the longest row's count); the target verifies
every row's [last token, drafts] in one forward; each row accepts its own longest prefix of drafts equal to the
target's argmax, plus the target's token after it (the bonus token), and advances its write slot by that count. A
row's rejected slots are not cleared: the row's next round writes over them, and until then no query of the row
attends to them (a mask reaches only up to the query's own slot). Drafts padded beyond a row's own proposal are
never accepted.

The target's attention is the batched decoder's `grouped_sdpa` (grouped-query KV heads handed to SDPA unrepeated).

Finished rows (a stop token or max_new_tokens) stay in the batch until every row is done: they add no tokens and no
counts to their trace, and their write slot stops advancing (each round recomputes the same slots, never read by
a live row). The batch does not shrink.

CUDA graphs (`cuda_graphs`): each model keeps one cache, write slots and starts per row count (`reserve`), reused
by every batch of that many rows, so a step of a shape (rows, tokens) is captured once and replayed for every batch
(`capture`: every shape before the timed batches). A step reads the rows' slots from device buffers and writes
nothing but the KV cache at them, so it can be replayed (and its capture's warm-up runs repeated); the host advances
the slots after it, and checks the cache's bounds against its own copy of them. The prompt's forward (its width
varies per batch) runs eagerly; so does everything on a CPU, where the tests check the same code. A reused cache
keeps an earlier batch's entries in slots no mask reaches: before a row's start, or past its write slot.

Timing: a batch is timed as a whole; each row's `seconds` (and `first_token_seconds`) is the batch's wall time
(and its prompt forward's) divided by its rows, so that a method's summed seconds are the batches' wall time and
its tokens/s the batch throughput.

EAGLE-3 cache: the draft's cache rows use the target's slot layout (draft slot s holds the draft's state for the
target's position at slot s, at position id s - start + 1, EAGLE-3's shift), so the row's start and mask carry
over; a round's inputs are padded to the longest row's count, and the padding, like the chain's entries, sits after
the row's verified slots, overwritten before anything attends to it.
"""

from __future__ import annotations

import functools
import time

import torch

from draftsmith.benchmark.proposers import PromptLookupProposer, draft_layers, prompt_lookup_candidates, use_sdpa
from draftsmith.benchmark.spec_decode import TargetModel, Trace, answer_done, cut_output, synchronize
from draftsmith.decoding.batch_kv import BatchKV, attention_configs, grouped_attention, left_padded, on_device, row_mask
from draftsmith.decoding.draft_kernels import fewer_kernels
from draftsmith.decoding.static_cache import StepGraphs

CACHE_GRANULE = 256  # cache slots a row, rounded up to this: batches of similar prompts share one cache


class RowBuffers:
    """One model's decoding buffers for batches of `rows` rows, reused batch after batch (captured steps address
    them): the KV cache, each row's first slot (`starts`) and next free slot (`lengths`), and the host's copy of the
    latter."""

    def __init__(self, rows: int, length: int, device):
        self.cache = BatchKV(rows, -(-length // CACHE_GRANULE) * CACHE_GRANULE)
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.host_lengths = [0] * rows

    def reset(self, starts: torch.Tensor, length: int) -> None:
        self.starts.copy_(starts)
        self.lengths.fill_(length)
        self.host_lengths = [length] * len(self.host_lengths)

    def advance(self, counts: list[int]) -> torch.Tensor:
        """Each row's next free slot `counts[row]` further on; returns the counts as a device tensor."""
        self.host_lengths = [n + c for n, c in zip(self.host_lengths, counts)]
        counts_t = torch.tensor(counts, dtype=torch.long, device=self.lengths.device)
        self.lengths += counts_t
        return counts_t

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


class BatchTarget:
    """The target of a `TargetModel` (its model and auxiliary-layer hooks) decoding B rows over one `BatchKV`."""

    MAX_GRAPH_WIDTH = 16  # wider steps (a prompt) run eagerly

    def __init__(self, target: TargetModel, cuda_graphs: bool = False):
        if not target.static:
            raise ValueError("batched decoding needs a full-attention SDPA target (its masks are built here)")
        self.target = target
        self.device = target.device
        self.buffers = RowBufferSet(cuda_graphs, self.device, tune_kernels=target.graphs.tune)
        self._attention = attention_configs(target.model)

    def reserve(self, rows: int, length: int) -> None:
        """Buffers for `rows` rows of at least `length` slots (the prompt's width and what follows it), so that the
        batches' `start` finds them and the steps captured on them stay."""
        self.rows = self.buffers.reserve(rows, length)

    @property
    def starts(self) -> torch.Tensor:
        """Each row's first slot (left padding before it) in the current batch."""
        return self.rows.starts

    def start(self, prompts: list[list[int]], capacity: int, with_aux: bool = False):
        """New rows: run the left-padded prompts; each row's cache holds the prompts' width plus `capacity` slots.
        Returns the last position's logits [B, V] and, with `with_aux`, the auxiliary states [B, width, 3H]."""
        self.prompt_ids, starts = left_padded(prompts, self.device)
        width = self.prompt_ids.shape[1]
        self.reserve(len(prompts), width + capacity)
        self.rows.reset(starts, 0)
        logits, aux = self._step(self.prompt_ids, keep=1, with_aux=with_aux)
        self.rows.reset(starts, width)
        return logits[:, -1], aux

    def forward(self, input_ids: torch.Tensor, with_aux: bool = False, keep: int | None = None):
        """Run `input_ids` [B, q], row r's at its slots lengths[r]..lengths[r]+q-1 (the caller then advances each
        row by what it keeps: `advance`). Returns the last `keep` (default q) positions' logits [B, keep, V] and, with
        `with_aux`, the auxiliary states [B, q, 3H]; a replayed step's outputs are overwritten by its next replay."""
        rows, q = input_ids.shape
        self.rows.check(q, "target's")
        step = functools.partial(self._step, keep=keep or q, with_aux=with_aux)
        if q > self.MAX_GRAPH_WIDTH:
            return step(input_ids)
        return self.buffers.graphs.run((rows, q, keep or q, with_aux), step, input_ids)

    def advance(self, counts: list[int]) -> torch.Tensor:
        """Each row's write slot `counts[row]` on (what it kept of the last forward); returns them on the device."""
        return self.rows.advance(counts)

    def _step(self, input_ids: torch.Tensor, keep: int, with_aux: bool):
        rows = self.rows
        slots = rows.lengths[:, None] + torch.arange(input_ids.shape[1], device=self.device)
        rows.cache.write_slots = slots
        try:
            with grouped_attention(self._attention):  # the regenerate decoder's attention: KV heads not repeated
                return self.target.call(keep, with_aux, input_ids=input_ids,
                                        attention_mask=row_mask(slots, rows.starts, rows.cache.length),
                                        position_ids=(slots - rows.starts[:, None]).clamp(min=0),
                                        cache_position=slots[0], past_key_values=rows.cache)
        finally:
            rows.cache.write_slots = None

    @torch.inference_mode()  # as the decoding loops: a graph's static inputs are inference tensors
    def capture(self, rows: int, k: int) -> None:
        """Capture now every step a decode of `rows` rows with up to k drafts takes (1..k+1 tokens; with and without
        the auxiliary states), so that none is captured inside a timed decode. Reserve the buffers first."""
        if not self.buffers.graphs.enabled:
            return
        self.start([[0]] * rows, capacity=k + 1)
        for q in range(1, k + 2):
            for with_aux in {False, bool(self.target.aux_layer_ids)}:
                self.forward(torch.zeros((rows, q), dtype=torch.long, device=self.device), with_aux=with_aux)


class BatchPromptLookupProposer(PromptLookupProposer):
    """Prompt-lookup (n-gram) drafts per row, from the row's prompt and its text so far."""

    def start(self, next_tokens, aux, starts, capacity: int) -> None:
        pass

    def propose(self, contexts: list[list[int]], k: int) -> tuple[torch.Tensor, list[int]]:
        """Drafts [B, m] (m: the most any row found; shorter rows padded with 0) and each row's own count."""
        found = [prompt_lookup_candidates(context, k, self.max_ngram) for context in contexts]
        m = max(len(f) for f in found)
        drafts = torch.tensor([f + [0] * (m - len(f)) for f in found], dtype=torch.long, device=self.device)
        return drafts.view(len(found), m), [len(f) for f in found]

    def accept(self, next_tokens, aux, counts) -> None:
        pass


class BatchEagle3Proposer:
    """Chain drafts of a speculators Eagle3DraftModel for B rows at once (proposers.Eagle3Proposer, batched).

    Per row: `lengths` of its buffers, the next free slot of its draft cache (one entry per verified position); the
    pending inputs of the next round (the newly verified tokens and the target's states before them) and how many
    are real. A round after a verification (k + 1 inputs a row) is one replay with `cuda_graphs` (its kernels tuned with
    `tune_kernels`, as the target's: `StepGraphs`)."""

    needs_aux = True

    def __init__(self, draft, cuda_graphs: bool = False, tune_kernels: bool = False):
        use_sdpa(draft)
        fewer_kernels(draft)
        self.draft = draft
        self.buffers = RowBufferSet(cuda_graphs, next(draft.parameters()).device, tune_kernels)

    def reserve(self, rows: int, length: int) -> None:
        """Buffers for `rows` rows of at least `length` slots (see BatchTarget.reserve)."""
        self.rows = self.buffers.reserve(rows, length)

    def start(self, next_tokens: torch.Tensor, aux: torch.Tensor, starts: torch.Tensor, capacity: int) -> None:
        """next_tokens [B, W]: at each prompt slot the token after it (the first generated token last), left-padded
        as the target's rows (`starts`); aux [B, W, 3H]; each row's cache holds W + `capacity` slots."""
        rows, width = next_tokens.shape
        self.reserve(rows, width + capacity)
        self.rows.reset(starts, 0)
        self.accept(next_tokens, aux, [width] * rows)

    def _layers(self, tokens: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        rows.cache.write_slots = slots
        try:
            return draft_layers(self.draft, tokens, hidden, (slots - rows.starts[:, None]).clamp(min=0) + 1, slots[0],
                                row_mask(slots, rows.starts, rows.cache.length), rows.cache)
        finally:
            rows.cache.write_slots = None

    def propose(self, contexts, k: int) -> tuple[torch.Tensor, list[int]]:
        """k chain drafts per row [B, k] (target vocabulary), and k for every row."""
        tokens, aux, counts = self.pending_tokens, self.pending_aux, self.counts
        rows, n = tokens.shape
        self.rows.check(n + k, "draft's")
        draft_round = functools.partial(self._round, k=k)
        if n <= k + 1:  # a round after a verification (the prompt's, W wide, runs eagerly)
            drafted = self.buffers.graphs.run((rows, n, k), draft_round, tokens, aux, counts)
        else:
            drafted = draft_round(tokens, aux, counts)
        self.rows.advance(self.host_counts)
        return drafted, [k] * rows

    def _round(self, tokens: torch.Tensor, aux: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
        """The round's inputs (each row's first counts[row] real) written from each row's next free slot, then k
        chain steps after them. Writes nothing but the cache (the host advances the slots after it)."""
        draft, verified = self.draft, self.rows.lengths
        rows, n = tokens.shape
        slots = verified[:, None] + torch.arange(n, device=tokens.device)
        out = self._layers(tokens, draft.fc(aux), slots)
        all_rows = torch.arange(rows, device=tokens.device)
        hidden = out[all_rows, (counts - 1).clamp(min=0)][:, None]  # each row's last real input (a finished row: any)
        chain = verified + counts  # the chain's first slot, right after the row's verified ones
        drafted = []
        for step in range(k):
            token = draft.lm_head(draft.norm(hidden)).argmax(-1)  # [B, 1], draft vocabulary
            token = token + draft.d2t[token]
            drafted.append(token)
            if step + 1 < k:
                hidden = self._layers(token, hidden, (chain + step)[:, None])
        return torch.cat(drafted, dim=-1)

    def accept(self, next_tokens: torch.Tensor, aux: torch.Tensor, counts: list[int]) -> None:
        """next_tokens [B, n]: per row, its first counts[row] are newly verified (the accepted drafts and the bonus
        token; 0 for a finished row); aux [B, n, 3H]: the target's states at the positions before them."""
        self.pending_tokens, self.pending_aux, self.host_counts = next_tokens, aux, counts
        self.counts = torch.tensor(counts, dtype=torch.long, device=next_tokens.device)

    @torch.inference_mode()
    def capture(self, rows: int, k: int) -> None:
        """Capture now the round after a verification for `rows` rows (see BatchTarget.capture)."""
        if not self.buffers.graphs.enabled:
            return
        fc = self.draft.fc
        tokens = torch.zeros((rows, k + 1), dtype=torch.long, device=fc.weight.device)
        aux = torch.zeros((rows, k + 1, fc.in_features), dtype=fc.weight.dtype, device=fc.weight.device)
        self.start(tokens[:, :1], aux[:, :1], torch.zeros(rows, dtype=torch.long, device=fc.weight.device), 2 * k + 2)
        self.propose([], k)
        self.accept(tokens, aux, [k + 1] * rows)
        self.propose([], k)


class BatchHybridProposer:
    """proposers.HybridProposer per row: prompt lookup's drafts in the rows whose context's last `min_ngram` or more
    tokens recur, the EAGLE-3 draft's in the others (its round runs for every row, keeping its cache current)."""

    needs_aux = True

    def __init__(self, lookup: BatchPromptLookupProposer, eagle: BatchEagle3Proposer, min_ngram: int):
        if not 1 <= min_ngram <= lookup.max_ngram:
            raise ValueError(f"hybrid_min_ngram must be within 1..prompt_lookup_ngram ({lookup.max_ngram}), got "
                             f"{min_ngram}")
        self.lookup, self.eagle, self.min_ngram = lookup, eagle, min_ngram
        self.rounds = {"prompt_lookup": 0, "eagle3": 0}  # row-rounds each source drafted

    def start(self, next_tokens, aux, starts, capacity: int) -> None:
        self.eagle.start(next_tokens, aux, starts, capacity)

    def propose(self, contexts: list[list[int]], k: int) -> tuple[torch.Tensor, list[int]]:
        """[B, k] drafts (a row's lookup drafts padded with 0 past its own count) and each row's count."""
        drafted, counts = self.eagle.propose(contexts, k)
        found = [prompt_lookup_candidates(c, k, self.lookup.max_ngram, self.min_ngram) for c in contexts]
        used = sum(1 for f in found if f)
        self.rounds["prompt_lookup"] += used
        self.rounds["eagle3"] += len(found) - used
        if not used:
            return drafted, counts
        lookup = on_device([f + [0] * (k - len(f)) for f in found], drafted.device)
        rows = on_device([int(bool(f)) for f in found], drafted.device).bool()
        return torch.where(rows[:, None], lookup, drafted), [len(f) or c for f, c in zip(found, counts)]

    def accept(self, next_tokens, aux, counts) -> None:
        self.eagle.accept(next_tokens, aux, counts)


def _share_times(traces: list[Trace], seconds: float, first_token_seconds: float) -> list[Trace]:
    for trace in traces:
        trace.seconds, trace.first_token_seconds = seconds / len(traces), first_token_seconds / len(traces)
    return traces


@torch.inference_mode()
def batch_greedy_decode(target: BatchTarget, prompts: list[list[int]], max_new_tokens: int,
                        stop_ids: set[int]) -> list[Trace]:
    """Target-only greedy decoding of every prompt at once, one target forward per step over all rows."""
    synchronize(target.device)
    start = time.perf_counter()
    logits, _ = target.start(prompts, capacity=max_new_tokens)
    next_tokens = logits.argmax(-1)
    traces = [Trace(tokens=[t], target_forwards=1) for t in next_tokens.tolist()]
    first_token_seconds = time.perf_counter() - start
    live = [not answer_done(t.tokens, t.tokens, max_new_tokens, stop_ids) for t in traces]
    while any(live):
        logits, _ = target.forward(next_tokens[:, None])
        target.advance([int(x) for x in live])  # a finished row's slot stays
        next_tokens = logits[:, -1].argmax(-1)
        for row, token in enumerate(next_tokens.tolist()):
            if live[row]:
                trace = traces[row]
                trace.tokens.append(token)
                trace.target_forwards += 1
                live[row] = not answer_done(trace.tokens, [token], max_new_tokens, stop_ids)
    synchronize(target.device)
    return _share_times(traces, time.perf_counter() - start, first_token_seconds)


@torch.inference_mode()
def batch_speculative_decode(target: BatchTarget, proposer, prompts: list[list[int]], k: int, max_new_tokens: int,
                             stop_ids: set[int]) -> list[Trace]:
    """Greedy speculative decoding of every prompt at once with `proposer` (BatchPromptLookupProposer or
    BatchEagle3Proposer)."""
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    device = target.device
    synchronize(device)
    start = time.perf_counter()
    capacity = max_new_tokens + 3 * (k + 1)  # the last round runs past the limit; a finished row redrafts past it
    logits, aux = target.start(prompts, capacity, with_aux=proposer.needs_aux)
    last = logits.argmax(-1)  # [B]
    traces = [Trace(tokens=[t], target_forwards=1) for t in last.tolist()]
    first_token_seconds = time.perf_counter() - start
    contexts = [list(p) + t.tokens for p, t in zip(prompts, traces)]  # host copies for n-gram lookup
    proposer.start(torch.cat([target.prompt_ids[:, 1:], last[:, None]], dim=1), aux, target.starts, capacity)
    live = [not answer_done(t.tokens, t.tokens, max_new_tokens, stop_ids) for t in traces]
    all_rows = torch.arange(len(prompts), device=device)
    while any(live):
        draft, proposed = proposer.propose(contexts, k)
        logits, aux = target.forward(torch.cat([last[:, None], draft], dim=1), with_aux=proposer.needs_aux)
        verified = logits.argmax(-1)  # [B, m + 1]: the target's token after each input position
        drafted, target_tokens = draft.tolist(), verified.tolist()  # the round's host sync
        counts = []
        for row, trace in enumerate(traces):
            if not live[row]:
                counts.append(0)
                continue
            accepted = 0
            while accepted < proposed[row] and drafted[row][accepted] == target_tokens[row][accepted]:
                accepted += 1
            new = target_tokens[row][: accepted + 1]
            trace.proposed.append(proposed[row])
            trace.accepted.append(accepted)
            trace.target_forwards += 1
            trace.tokens += new
            contexts[row] += new
            counts.append(accepted + 1)
            live[row] = not answer_done(trace.tokens, new, max_new_tokens, stop_ids)
        proposer.accept(verified, aux, counts)
        counts = target.advance(counts)  # everything a row verified but its bonus token, which the next round feeds
        last = verified[all_rows, (counts - 1).clamp(min=0)]
    synchronize(device)
    for trace in traces:
        trace.tokens = cut_output(trace.tokens, max_new_tokens, stop_ids)
    return _share_times(traces, time.perf_counter() - start, first_token_seconds)
