"""The proposers of the engine (draftsmith.decoding.engine.serve) and of the reference loop (one row, run eagerly), for
N rows in flight:
`begin(rows, length)` (no request yet), `prefill(rows, prompts, first)` (the rows that take new requests: the target's
`AdmittedPrompts` and first tokens), `propose(contexts, k)` (per row up to k drafts, [B, m] padded, and each row's
count) and `accept(next_tokens, aux, counts)` (what the target verified, per row): `Proposer`. A new draft method is
one Proposer subclass and one entry in draftsmith.benchmark.methods.

EAGLE-3 conventions (speculators 0.3.0, `Eagle3DraftModel.forward` after `shift_batch`): draft position t reads
`cat(embed(x[t+1]), fc(cat(aux states at t)))` at position id t+1 and predicts x[t+2]; each further chain step feeds
the embedding of the token just drafted with the draft's own last-layer output (before `norm`) at the next position
id, attending to the verified context and to its own chain. Draft token d maps to target token d + d2t[d].

EAGLE-3 cache: the draft's cache rows use the target's slot layout (draft slot s holds the draft's state for the
target's position at slot s, at position id s - start + 1, EAGLE-3's shift), so the row's start and mask carry
over. A request's prompt is prefilled into the draft cache up to its last position; that position (the first
generated token with the target's states at the prompt's end) is the row's one pending input of the next joint round.
A round's inputs are padded to the longest row's count, and the padding, like the chain's entries, sits after the
row's verified slots, overwritten before anything attends to it.
"""

from __future__ import annotations

import functools

import torch

from draftsmith.decoding.batch_kv import (
    RAGGED,
    attention_configs,
    grouped_attention,
    on_device,
    prefill_layout,
    ragged_bounds,
    row_mask,
)
from draftsmith.decoding.draft_kernels import draft_layers, fuse_rms_norms, tabulate_rotary, use_sdpa
from draftsmith.decoding.batch_target import AdmittedPrompts, RowBufferSet, captured_prefill_widths
from draftsmith.decoding.ngrams import ContextNgrams


class Proposer:
    """The interface (see the module's docstring), with nothing to keep between rounds: a proposer that keeps no state
    on the device overrides `propose` alone."""

    needs_aux = False  # whether `accept` needs the target's auxiliary states (EAGLE-3's inputs)

    def begin(self, rows: int, length: int) -> None:
        pass

    def prefill(self, rows: list[int], prompts: AdmittedPrompts, first: torch.Tensor) -> None:
        pass

    def propose(self, contexts: list[list[int]], k: int) -> tuple[torch.Tensor, list[int]]:
        raise NotImplementedError

    def accept(self, next_tokens, aux, counts) -> None:
        pass


class NoDrafts(Proposer):
    """Target-only decoding: no drafts. `serve` then decodes each round on the device alone (`BatchTarget.decode`:
    greedy or sampled, one step a round or several); the reference loop verifies its one-token rounds."""

    def propose(self, contexts: list[list[int]], k: int) -> tuple[torch.Tensor, list[int]]:
        return torch.zeros((len(contexts), 0), dtype=torch.long), [0] * len(contexts)


class PromptLookupProposer(Proposer):
    """Prompt-lookup (n-gram) drafts per row, from the row's prompt and its text so far."""

    def __init__(self, max_ngram: int, device: torch.device):
        if max_ngram < 1:
            raise ValueError(f"prompt_lookup_ngram must be >= 1, got {max_ngram}")
        self.max_ngram, self.device = max_ngram, device
        self.ngrams = ContextNgrams(max_ngram)

    def propose(self, contexts: list[list[int]], k: int) -> tuple[torch.Tensor, list[int]]:
        """Drafts [B, m] (m: the most any row found; shorter rows padded with 0) and each row's own count."""
        found = [self.ngrams.candidates(row, context, k) for row, context in enumerate(contexts)]
        m = max(len(f) for f in found)
        drafts = torch.tensor([f + [0] * (m - len(f)) for f in found], dtype=torch.long, device=self.device)
        return drafts.view(len(found), m), [len(f) for f in found]


class BatchEagle3Proposer(Proposer):
    """Chain drafts of a speculators Eagle3DraftModel for B rows at once (the reference loop's too, at one row).

    Per row: `lengths` of its buffers, the next free slot of its draft cache (one entry per verified position); the
    pending inputs of the next round (the newly verified tokens and the target's states before them) and how many
    are real. A round after a verification (k + 1 inputs a row) is one replay with `cuda_graphs`. `fewer_kernels`: the
    draft's norms fused and its rotary embedding a table (draftsmith.decoding.draft_kernels; off: its modules as
    built). `ragged`: the round's attention reads each row's own slots (the target's ragged kernel,
    draftsmith.decoding.ragged_attention) rather than the whole cache through a mask."""

    needs_aux = True

    def __init__(self, draft, cuda_graphs: bool = False, fewer_kernels: bool = True, ragged: bool = False):
        self.buffers = RowBufferSet(cuda_graphs, next(draft.parameters()).device, ragged=ragged)
        use_sdpa(draft)
        if fewer_kernels:
            fuse_rms_norms(draft)
            tabulate_rotary(draft)
        self.draft, self.ragged = draft, ragged
        self._attention = attention_configs(draft)

    def reserve(self, rows: int, length: int) -> None:
        """Buffers for `rows` rows of at least `length` slots (see BatchTarget.reserve)."""
        self.rows = self.buffers.reserve(rows, length)

    def begin(self, rows: int, length: int) -> None:
        """`rows` rows of at least `length` slots, none holding a request yet."""
        self.reserve(rows, length)
        self.rows.clear()
        self.accept(*self._zeros(rows, 1), [0] * rows)

    def _zeros(self, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero inputs of `rows` rows, n positions each: tokens [rows, n] and the target's states [rows, n, 3H]."""
        fc = self.draft.fc
        return (torch.zeros((rows, n), dtype=torch.long, device=fc.weight.device),
                torch.zeros((rows, n, fc.in_features), dtype=fc.weight.dtype, device=fc.weight.device))

    def prefill(self, rows: list[int], prompts: AdmittedPrompts, first: torch.Tensor) -> None:
        """New requests in `rows` (the target's prefill: its padded prompts and their first generated tokens [R]): the
        draft's inputs at every prompt slot but the last (the token after the slot, the target's states at it) into
        those rows' caches, the last one pending. It runs over the prompts' whole padded width, as the target's prefill
        does (what it writes past a right-padded prompt's end lies past the row's next free slot, overwritten before
        anything attends to it), so that a capture per (buffers' rows, rows, width) serves every prompt length: run
        eagerly, each new length cost a new kernel plan (a cuDNN attention graph is built per shape), about 50 ms of a
        request's time to first token on one H100 (perf/results/smollm2_h100_concurrency_2026-12-07b)."""
        ids, starts, last = prompts.ids, prompts.starts, prompts.last
        tokens = ids.roll(-1, dims=1)  # at slot s the token after it; the first generated token after the last
        tokens[:, last] = first
        index = on_device(rows, tokens.device)
        width = tokens.shape[1] - 1
        if width > 0:
            self.buffers.prefill(self.rows, (len(rows), width), self._prefill_step, tokens[:, :-1], prompts.aux[:, :-1],
                                 starts, index)
        self.rows.admit(rows, starts, last)
        self.pending_tokens, self.pending_aux = self.pending_tokens.clone(), self.pending_aux.clone()
        self.pending_tokens[index, 0] = first
        self.pending_aux[index, 0] = prompts.aux[:, last]
        self.counts = self.counts.index_fill(0, index, 1)
        for row in rows:
            self.host_counts[row] = 1

    def _prefill_step(self, tokens: torch.Tensor, aux: torch.Tensor, starts: torch.Tensor, index: torch.Tensor):
        """The draft's prompt inputs (tokens [R, W], the target's states [R, W, 3H], starting at `starts`) into cache
        rows `index`, on the device alone (what a graph captures)."""
        slots, mask, positions = prefill_layout(starts, tokens.shape[1])
        with self.rows.cache.writing(prefill_rows=index) as cache:
            return draft_layers(self.draft, tokens, self.draft.fc(aux), positions + 1, slots, mask, cache)

    def _layers(self, tokens: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The draft's layers on a round's inputs at each row's consecutive `slots` [B, n], each attending to its row's
        slots from its start up to its own."""
        rows = self.rows
        if self.ragged:
            mask, attention = ragged_bounds(rows.starts, slots[:, 0]), RAGGED
        else:
            mask, attention = row_mask(slots, rows.starts, rows.cache.length), "sdpa"  # as use_sdpa set it
        positions = (slots - rows.starts[:, None]).clamp(min=0) + 1
        with rows.cache.writing(write_slots=slots) as cache, grouped_attention(self._attention, attention):
            return draft_layers(self.draft, tokens, hidden, positions, slots[0], mask, cache)

    def propose(self, contexts, k: int, chain: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """A chain of `chain` (default k) drafts per row [B, chain] (target vocabulary), and that count for every row; a
        chain of 0 only feeds the cache the newly verified inputs (a round whose drafts come from elsewhere)."""
        chain = k if chain is None else chain
        rows, n = self.pending_tokens.shape
        self.rows.check(n + k, "draft's")
        # n: 1 after `begin`, else the last verification's k + 1 (a prompt's inputs come in through `prefill`)
        drafted = self.buffers.graphs.run((rows, n, chain), functools.partial(self._round, k=chain),
                                          self.pending_tokens, self.pending_aux, self.counts)
        self.rows.advance(self.host_counts)
        return drafted, [chain] * rows

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
        drafted = [tokens[:, :0]]
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
        self.counts = on_device(counts, next_tokens.device)

    @torch.inference_mode()
    def capture(self, rows: int, k: int, longest_prompt: int | None = None) -> None:
        """Capture now the round after a verification for `rows` rows and, given the longest prompt, one row's prefill
        at every bucket up to its (see BatchTarget.capture)."""
        if not self.buffers.graphs.enabled:
            return
        tokens, aux = self._zeros(rows, k + 1)
        self.rows.clear()
        for n in range(1, k + 2):  # 1 after `begin`; after a verification of m drafts m + 1 (the hybrid's m can be < k)
            for chain in (k, 0):  # 0: the hybrid's rounds where every row takes prompt lookup's drafts
                self.accept(tokens[:, :n], aux[:, :n], [n] * rows)
                self.propose([], k, chain)
        for bucket in captured_prefill_widths(longest_prompt, self.rows.cache.length):
            ids, states = self._zeros(1, bucket)
            self.prefill([0], AdmittedPrompts(ids, ids[:, 0], bucket - 1, states), ids[:, 0])
        self.rows.clear()


class HybridProposer(Proposer):
    """Prompt lookup's drafts (a PromptLookupProposer's) in the rows whose context's last `min_ngram` or more tokens
    recur (n-grams of up to the lookup's max_ngram), the EAGLE-3 draft's (a BatchEagle3Proposer's) in the others. The
    draft's round runs for every row either way: it feeds the draft the newly verified positions, so its cache stays
    current whichever drafts the target verified; at batch 1 a round that takes lookup's drafts skips the draft's
    chain. `rounds` counts the row-rounds each source drafted."""

    needs_aux = True

    def __init__(self, lookup: PromptLookupProposer, eagle, min_ngram: int):
        if not 1 <= min_ngram <= lookup.max_ngram:
            raise ValueError(f"hybrid_min_ngram must be within 1..prompt_lookup_ngram ({lookup.max_ngram}), got "
                             f"{min_ngram}")
        self.lookup, self.eagle, self.min_ngram = lookup, eagle, min_ngram
        self.rounds = {"prompt_lookup": 0, "eagle3": 0}

    def begin(self, rows: int, length: int) -> None:
        self.eagle.begin(rows, length)

    def prefill(self, rows: list[int], prompts: AdmittedPrompts, first: torch.Tensor) -> None:
        self.eagle.prefill(rows, prompts, first)

    def propose(self, contexts: list[list[int]], k: int) -> tuple[torch.Tensor, list[int]]:
        """[B, m] drafts (a row's lookup drafts padded with 0 past its own count; m = k where some row takes the draft's
        chain, else the most lookup found) and each row's count. With one row the lookup comes first, and a round it
        answers skips the draft's chain; with several, where every row rarely finds a match, the draft's round is
        queued first and the host looks up while the device runs it."""
        if len(contexts) > 1:
            drafted, counts = self.eagle.propose(contexts, k)
        found = [self.lookup.ngrams.candidates(row, c, k, self.min_ngram) for row, c in enumerate(contexts)]
        used = sum(1 for f in found if f)
        self.rounds["prompt_lookup"] += used
        self.rounds["eagle3"] += len(found) - used
        everyone = used == len(found)
        if len(contexts) == 1:
            drafted, counts = self.eagle.propose(contexts, k, chain=0 if everyone else k)
        if not used:
            return drafted, counts
        width = max(len(f) for f in found) if everyone else k  # every row's lookup: verify no wider than they found
        lookup = on_device([f + [0] * (width - len(f)) for f in found], drafted.device)
        if everyone:
            return lookup, [len(f) for f in found]
        rows = on_device([int(bool(f)) for f in found], drafted.device).bool()
        return torch.where(rows[:, None], lookup, drafted), [len(f) or c for f, c in zip(found, counts)]

    def accept(self, next_tokens, aux, counts) -> None:
        self.eagle.accept(next_tokens, aux, counts)
