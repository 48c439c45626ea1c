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
a live row). The batch does not shrink. Decoding is eager: no CUDA graphs for the batched path.

Timing: a batch is timed as a whole; each row's `seconds` (and `first_token_seconds`) is the batch's wall time
(and its prompt forward's) divided by its rows, so that a method's summed seconds are the batches' wall time and
its tokens/s the batch throughput.

EAGLE-3 cache: the draft's cache rows use the target's slot layout (draft slot s holds the draft's state for the
target's position at slot s, at position id s - start + 1, EAGLE-3's shift), so the row's start and mask carry
over; a round's inputs are padded to the longest row's count, and the padding, like the chain's entries, sits after
the row's verified slots, overwritten before anything attends to it.
"""

from __future__ import annotations

import time

import torch

from draftsmith.benchmark.spec_decode import (
    Trace,
    PromptLookupProposer,
    TargetModel,
    answer_done,
    cut_output,
    draft_layers,
    prompt_lookup_candidates,
    synchronize,
    use_sdpa,
)
from draftsmith.decoding.batch import BatchKV, attention_configs, grouped_attention, left_padded, row_mask


class BatchTarget:
    """The target of a `TargetModel` (its model and auxiliary-layer hooks) decoding B rows over one `BatchKV`."""

    def __init__(self, target: TargetModel):
        if not target.static:
            raise ValueError("batched decoding needs a full-attention SDPA target (its masks are built here)")
        self.target = target
        self.device = target.device
        self._attention = attention_configs(target.model)

    def start(self, prompts: list[list[int]], capacity: int, with_aux: bool = False):
        """New rows: run the left-padded prompts; each row's cache holds the prompts' width plus `capacity` slots.
        Returns the last position's logits [B, V] and, with `with_aux`, the auxiliary states [B, width, 3H]."""
        self.prompt_ids, self.starts = left_padded(prompts, self.device)
        width = self.prompt_ids.shape[1]
        self.cache = BatchKV(len(prompts), width + capacity)
        self.lengths = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
        logits, aux = self.forward(self.prompt_ids, with_aux, keep=1)
        self.lengths.fill_(width)
        return logits[:, -1], aux

    def forward(self, input_ids: torch.Tensor, with_aux: bool = False, keep: int | None = None):
        """Run `input_ids` [B, q], row r's at its slots lengths[r]..lengths[r]+q-1 (the caller advances `lengths` by
        what each row keeps). Returns the last `keep` (default q) positions' logits [B, keep, V] and, with
        `with_aux`, the auxiliary states [B, q, 3H]."""
        q = input_ids.shape[1]
        slots = self.lengths[:, None] + torch.arange(q, device=self.device)
        if int(slots.max()) >= self.cache.length:
            raise ValueError(f"the batched KV cache holds {self.cache.length} slots a row; slot {int(slots.max())} "
                             "asked for")
        self.cache.write_slots = slots
        try:
            with grouped_attention(self._attention):  # the regenerate decoder's attention: KV heads not repeated
                return self.target.call(keep or q, with_aux, input_ids=input_ids,
                                        attention_mask=row_mask(slots, self.starts, self.cache.length),
                                        position_ids=(slots - self.starts[:, None]).clamp(min=0),
                                        cache_position=slots[0], past_key_values=self.cache)
        finally:
            self.cache.write_slots = None


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
    """Chain drafts of a speculators Eagle3DraftModel for B rows at once (spec_decode.Eagle3Proposer, batched).

    Per row: `verified`, the next free slot of its draft cache (one entry per verified position); the pending inputs
    of the next round (the newly verified tokens and the target's states before them) and how many are real."""

    needs_aux = True

    def __init__(self, draft):
        use_sdpa(draft)
        self.draft = draft

    def start(self, next_tokens: torch.Tensor, aux: torch.Tensor, starts: torch.Tensor, capacity: int) -> None:
        """next_tokens [B, W]: at each prompt slot the token after it (the first generated token last), left-padded
        as the target's rows (`starts`); aux [B, W, 3H]; each row's cache holds W + `capacity` slots."""
        rows, width = next_tokens.shape
        self.cache = BatchKV(rows, width + capacity)
        self.starts = starts
        self.verified = torch.zeros(rows, dtype=torch.long, device=next_tokens.device)
        self.accept(next_tokens, aux, torch.full_like(self.verified, width))

    def _layers(self, tokens: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.cache.write_slots = slots
        try:
            return draft_layers(self.draft, tokens, hidden, (slots - self.starts[:, None]).clamp(min=0) + 1, slots[0],
                                row_mask(slots, self.starts, self.cache.length), self.cache)
        finally:
            self.cache.write_slots = None

    def propose(self, contexts, k: int) -> tuple[torch.Tensor, list[int]]:
        """k chain drafts per row [B, k] (target vocabulary), and k for every row."""
        draft, tokens, aux, counts = self.draft, self.pending_tokens, self.pending_aux, self.counts
        rows, n = tokens.shape
        if int(self.verified.max()) + n + k > self.cache.length:
            raise ValueError(f"the draft's batched KV cache holds {self.cache.length} slots a row; "
                             f"{int(self.verified.max())} + {n} + {k} asked for")
        slots = self.verified[:, None] + torch.arange(n, device=tokens.device)
        out = self._layers(tokens, draft.fc(aux), slots)
        all_rows = torch.arange(rows, device=tokens.device)
        hidden = out[all_rows, (counts - 1).clamp(min=0)][:, None]  # each row's last real input (a finished row: any)
        chain = self.verified + counts  # the chain's first slot, right after the row's verified ones
        drafted = []
        for step in range(k):
            token = draft.lm_head(draft.norm(hidden)).argmax(-1)  # [B, 1], draft vocabulary
            token = token + draft.d2t[token]
            drafted.append(token)
            if step + 1 < k:
                hidden = self._layers(token, hidden, (chain + step)[:, None])
        self.verified = chain
        return torch.cat(drafted, dim=-1), [k] * rows

    def accept(self, next_tokens: torch.Tensor, aux: torch.Tensor, counts: torch.Tensor) -> None:
        """next_tokens [B, n]: per row, its first counts[row] are newly verified (the accepted drafts and the bonus
        token; 0 for a finished row); aux [B, n, 3H]: the target's states at the positions before them."""
        self.pending_tokens, self.pending_aux, self.counts = next_tokens, aux, counts


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
        target.lengths += torch.tensor(live, device=target.device)  # a finished row's slot stays
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
        counts = torch.tensor(counts, device=device)
        target.lengths += counts  # everything a row verified but its bonus token, which the next round feeds
        last = verified[all_rows, (counts - 1).clamp(min=0)]
        proposer.accept(verified, aux, counts)
    synchronize(device)
    for trace in traces:
        trace.tokens = cut_output(trace.tokens, max_new_tokens, stop_ids)
    return _share_times(traces, time.perf_counter() - start, first_token_seconds)
