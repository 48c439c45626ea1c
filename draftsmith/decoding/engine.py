"""The decoding engine, of the benchmark and of regenerate alike: N requests in flight (N = 1 at batch 1), each row
taking the next prompt as soon as its answer ends (refill); speculative decoding with greedy verification, and
target-only decoding, greedy or sampled.

`serve` (its requests' bookkeeping a `Flight`, its loop of refills and rounds `Rounds`) decodes N rows over one static
KV cache per model (`BatchKV` of draftsmith.decoding.batch_kv, one row per request), with the stopping rule and the
`Trace` of the eager reference loops (draftsmith.decoding.reference), so a row's output is comparable token for token
with the reference's. `generate` is regenerate's entry (target-only, many prompts, a prompt's samples sharing one
prefill). The target's side of a round, its rows' cache, slots, masks and CUDA graphs, is
draftsmith.decoding.batch_target; the proposers for rows in flight (prompt lookup, EAGLE-3, the hybrid) are
draftsmith.decoding.engine_proposers.

Speculative round (temperature 0): the proposer drafts per row (EAGLE-3: one draft forward over all rows per chain
step; prompt lookup: an n-gram lookup per row, the drafts padded to the longest row's count); the target verifies
every row's [last token, drafts] in one forward; each row accepts its own longest prefix of drafts equal to the
target's argmax, plus the target's token after it (the bonus token), and advances its write slot by that count. A
row's rejected slots are not cleared: the row's next round writes over them, and until then no query of the row
attends to them. Drafts padded beyond a row's own proposal are never accepted.

Target-only round (`NoDrafts`): `steps` decode steps on the device alone, each choosing every row's next token
(sampling.choose_tokens: greedy, or a seeded draw per row and token index, so an answer depends on its prompt and seed
only) and feeding it to the next; the host reads the round's tokens in one copy. With several steps a round
(regenerate) the host reads each round while the device decodes the next (a row whose answer ended stops on the device,
`RowBuffers.stop_at`, and waits there until the host reads it), so its refills and bookkeeping overlap the device's
work.

Timing, as a server's client sees it: the run's wall time is shared by its requests (`seconds`: wall time over the
requests, so a method's summed seconds are the run's wall time and its tokens/s the throughput); per request, the time
from its admission to its first token (`ttft_seconds`) and the time per output token after it (`tpot_seconds`).
"""

from __future__ import annotations

import time

import torch

from draftsmith.decoding.batch_kv import on_device
from draftsmith.decoding.batch_target import MAX_ROUND_STEPS, BatchTarget
from draftsmith.decoding.engine_proposers import NoDrafts
from draftsmith.decoding.sampling import Sampling
from draftsmith.decoding.static_cache import prompt_bucket
from draftsmith.decoding.trace import Trace, cut_output, synchronize


def serve_length(prompts: list[list[int]], max_new_tokens: int, k: int, bucketed: bool = True) -> int:
    """The slots a row of `serve` needs: the longest prompt (padded to its bucket where prefills are), the answer, and
    with k drafts the last rounds past it (target-only: k = 0; a row that decodes past its answer's end stays at the
    cache's last slot, `BatchTarget.decode`)."""
    longest = max(len(p) for p in prompts)
    return (prompt_bucket(longest) if bucketed else longest) + max_new_tokens + (3 * (k + 1) if k else 0)


@torch.inference_mode()
def serve(target: BatchTarget, proposer, prompts: list[list[int]], concurrency: int, k: int, max_new_tokens: int,
          stop_ids: set[int], sampling: Sampling | None = None, seeds: list[int] | None = None, steps: int = 1,
          progress=None, every_row: bool = False, refill_rounds: float = 0.0) -> list[Trace]:
    """Every prompt decoded with `concurrency` requests in flight, in order, rows taking the next prompts as their
    answers end (prefills of at most `target.prefill_limit` tokens, `Rounds.refill_due`), each answer cut by the
    stopping rule: speculative with `proposer` (greedy verification, up to k drafts a round), or with NoDrafts
    target-only, greedy or sampled (`sampling`, a seed per prompt), `steps` decode steps a round. A round of several
    steps is read one round late: the device decodes the next round while the host reads this one and refills (a row
    whose answer ended stops on the device and waits there to be read). `progress(n)`: n more answers done.
    `every_row`: all `concurrency` rows even for fewer prompts (regenerate's chunks then share one set of buffers and
    graphs), else at most one a prompt. `refill_rounds`: what a refill costs, in rounds; free rows wait for the next
    prompts until the rounds they sat idle add up to that many rounds of every row (0: a refill once 1/64 of the rows
    are free)."""
    sampling = sampling or Sampling()
    drafting = not isinstance(proposer, NoDrafts)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    if drafting and not sampling.greedy:
        raise ValueError("speculative decoding here verifies greedily: sampling needs target-only decoding")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not 1 <= steps <= MAX_ROUND_STEPS:
        raise ValueError(f"a round takes 1 to {MAX_ROUND_STEPS} decode steps, got {steps}")
    rows = concurrency if every_row else min(concurrency, len(prompts))
    length = serve_length(prompts, max_new_tokens, k if drafting else 0, target.bucketed_prefills)
    target.begin(rows, length)
    target.rows.stop_at(stop_ids, max_new_tokens)
    proposer.begin(rows, length)
    flight = Flight(prompts, rows, max_new_tokens, set(stop_ids), drafting)
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    return Rounds(target, proposer, flight, k, sampling, seeds, steps, progress, refill_rounds)()


class Flight:
    """The requests of one `serve` run: the queue of prompts, each row's request (`owner`, -1: none) and the first
    round it is in (`since`), the host's copy of each drafting row's context (for n-gram lookup), and each request's
    trace and times (admitted: a refilled request when its row came free; finished)."""

    def __init__(self, prompts: list[list[int]], rows: int, max_new_tokens: int, stop_ids: set[int], drafting: bool):
        self.prompts, self.max_new_tokens, self.stop_ids, self.drafting = prompts, max_new_tokens, stop_ids, drafting
        self.queue = list(range(len(prompts)))[::-1]  # pop() takes the next
        self.owner, self.since = [-1] * rows, [0] * rows
        self.contexts: list[list[int]] = [[] for _ in range(rows)]
        self.traces: list[Trace | None] = [None] * len(prompts)
        self.admitted, self.finished = [0.0] * len(prompts), [0.0] * len(prompts)

    def next_prompts(self, free: int, limit: int) -> list[int]:
        """The queue's next prompts for one prefill: at most one a free row, distinct prompts x the longest at most
        `limit` tokens (one at least)."""
        take, distinct, longest = [], set(), 0
        while self.queue and len(take) < free:
            prompt = tuple(self.prompts[self.queue[-1]])
            if take and (len(distinct) + (prompt not in distinct)) * max(longest, len(prompt)) > limit:
                break
            take.append(self.queue.pop())
            distinct.add(prompt)
            longest = max(longest, len(prompt))
        return take

    def admit(self, rows: list[int], take: list[int], sent: list[float], round_: int) -> None:
        """Requests `take` into `rows`, each sent at its time of `sent`, their first round `round_`."""
        for row, i, at in zip(rows, take, sent):
            self.admitted[i], self.owner[row], self.since[row] = at, i, round_
            self.traces[i] = Trace(tokens=[], target_forwards=0)
            self.contexts[row] = list(self.prompts[i]) if self.drafting else []

    def record(self, row: int, new: list[int], forwards: int, now: float, free: list[int]) -> None:
        """`new` tokens of the row's answer (cut by the stopping rule), from `forwards` target forwards; a row whose
        answer ended joins `free`."""
        i = self.owner[row]
        trace = self.traces[i]
        if not trace.tokens:
            trace.first_token_seconds = trace.ttft_seconds = now - self.admitted[i]
        # most rows go on: checked at C speed, a round of regenerate's 2,048 rows x 16 tokens costs the host
        # milliseconds (a Python loop over every token cost it about as much as the device's round)
        done = len(trace.tokens) + len(new) >= self.max_new_tokens or not self.stop_ids.isdisjoint(new)
        if done:
            new = cut_output(new, self.max_new_tokens - len(trace.tokens), self.stop_ids)
        trace.tokens += new
        trace.target_forwards += forwards
        if self.drafting:
            self.contexts[row] += new
        if done:
            self.finished[i], self.owner[row] = now, -1
            free.append(row)

    def busy(self) -> bool:
        return any(o >= 0 for o in self.owner)

    def results(self, wall: float) -> list[Trace]:
        """The traces, each with its share of the run's `wall` time (summed: the run's throughput) and its time per
        output token after the first."""
        for i, trace in enumerate(self.traces):
            trace.seconds = wall / len(self.traces)
            after_first = self.finished[i] - self.admitted[i] - trace.ttft_seconds
            trace.tpot_seconds = after_first / (len(trace.tokens) - 1) if len(trace.tokens) > 1 else None
        return self.traces


class Rounds:
    """`serve`'s loop over a `Flight`: refills, and speculative or target-only rounds, until every request is done
    (`progress(n)`: n more answers done, once a round and once a refill). `target.stats` counts the refills, their
    prefills and their wall time (a refill ends with the host reading its first tokens)."""

    def __init__(self, target: BatchTarget, proposer, flight: Flight, k: int, sampling: Sampling, seeds: list[int],
                 steps: int, progress=None, refill_rounds: float = 0.0):
        self.target, self.proposer, self.flight, self.k = target, proposer, flight, k
        self.sampling, self.seeds, self.steps, self.progress = sampling, seeds, steps, progress
        self.rows = len(flight.owner)
        self.lagging = not flight.drafting and steps > 1  # target-only rounds read one round late
        self.last = torch.zeros(self.rows, dtype=torch.long, device=target.device)  # each drafting row's next input
        self.looks: list = []  # target-only rounds launched and not yet read: (round, read)
        self.launched = 0  # rounds launched
        self.free: dict[int, float] = {}  # rows without a request, waiting for a refill: when each came free
        self.idle = 0  # rounds the waiting rows sat idle since the last refill, summed over the rows
        self.refill_at, self.idle_budget = max(1, self.rows // 64), refill_rounds * self.rows

    def __call__(self) -> list[Trace]:
        device = self.target.device
        synchronize(device)
        start = time.perf_counter()
        self.free = dict.fromkeys(range(self.rows), start)
        self.refill()
        while self.flight.busy():
            self.idle += len(self.free)
            ended: list[int] = []
            now = self.verify(ended) if self.flight.drafting else self.decode(ended)
            if now is not None:
                self.done(ended)
                self.target.rows.release(ended)
                self.free.update(dict.fromkeys(ended, now))
                self.refill()
        synchronize(device)
        return self.flight.results(time.perf_counter() - start)

    def refill_due(self) -> bool:
        """Whether the free rows take the next prompts now: all rows are free, or the queue's rest fits them, or at
        least 1/64 of the rows are free and their idle row-rounds reach the budget. A prefill costs about a step
        whatever its rows (a small target's is launch-bound), so batching refills trades idle rows for fewer
        prefills: waiting until the idle row-rounds reach one prefill's cost in row-rounds (`refill_rounds` x rows)
        is the economic order quantity's rule, the least idle time plus prefill time per request."""
        free, queued = len(self.free), len(self.flight.queue)
        return bool(free and queued) and (free == self.rows or free >= queued
                                          or (free >= self.refill_at and self.idle >= self.idle_budget))

    def refill(self) -> None:
        """The next prompts into the free rows, once a refill is due. A client in a closed loop sends its next request
        as its last answer ends: a request's time to first token counts from when its row came free."""
        target, flight, free = self.target, self.flight, self.free
        if not self.refill_due():
            return
        self.idle = 0
        target.stats["refills"] += 1
        began = time.perf_counter()
        while free and flight.queue:
            take = flight.next_prompts(len(free), target.prefill_limit)
            used = list(free)[: len(take)]
            admitted, logits = target.prefill(used, [flight.prompts[i] for i in take], with_aux=self.proposer.needs_aux)
            first = target.first_tokens(used, logits, self.sampling, [self.seeds[i] for i in take])
            self.proposer.prefill(used, admitted, first)
            flight.admit(used, take, [free.pop(row) for row in used], self.launched)
            if self.lagging:  # the first tokens come with the next round's (column 0)
                continue
            if flight.drafting:
                self.last[on_device(used, target.device)] = first
            firsts, now = first.tolist(), time.perf_counter()
            done: list[int] = []
            for row, token in zip(used, firsts):
                flight.record(row, [token], 1, now, done)
            target.rows.release(done)
            self.done(done)
            free.update(dict.fromkeys(done, now))
        target.stats["refill_seconds"] += time.perf_counter() - began

    def done(self, rows: list[int]) -> None:
        if rows and self.progress is not None:
            self.progress(len(rows))

    def verify(self, free: list[int]) -> float:
        """A speculative round: each row's drafts verified in one target forward, each row accepting its own longest
        prefix of drafts equal to the target's tokens, plus the target's token after it."""
        target, proposer, flight = self.target, self.proposer, self.flight
        draft, proposed = proposer.propose(flight.contexts, self.k)
        m = draft.shape[1]
        inputs = torch.cat([self.last[:, None], draft], dim=1) if m else self.last[:, None]
        logits, aux = target.forward(inputs, with_aux=proposer.needs_aux)
        verified = logits.argmax(-1)  # [B, m + 1]: the target's token after each input position
        both = (torch.cat([draft, verified], dim=1) if m else verified).tolist()  # the round's one host sync
        drafted, target_tokens = [b[:m] for b in both], [b[m:] for b in both]
        now = time.perf_counter()
        counts = [0] * self.rows
        for row, i in enumerate(flight.owner):
            if i < 0:
                continue
            accepted = 0
            while accepted < proposed[row] and drafted[row][accepted] == target_tokens[row][accepted]:
                accepted += 1
            flight.traces[i].proposed.append(proposed[row])
            flight.traces[i].accepted.append(accepted)
            counts[row] = accepted + 1
            flight.record(row, target_tokens[row][: accepted + 1], 1, now, free)
        proposer.accept(verified, aux, counts)
        target.advance(counts)  # everything a row verified but its bonus token, which the next round feeds
        # the bonus tokens from the host's copy: one queued copy rather than a round of indexing kernels
        self.last = on_device([tokens[c - 1] if c else 0 for tokens, c in zip(target_tokens, counts)], target.device)
        return now

    def decode(self, free: list[int]) -> float | None:
        """A target-only round of `steps` decode steps on the device; with several a round, the round before it read
        (None while none is: the first round)."""
        target, flight = self.target, self.flight
        ran = target.decode(self.steps, self.sampling)
        self.looks.append((self.launched, target.rows.look(ran + 1)))
        self.launched += 1
        if self.lagging and len(self.looks) < 2:
            return None
        round_, read = self.looks.pop(0)
        tokens, now = read(), time.perf_counter()
        for row, i in enumerate(flight.owner):
            if i >= 0 and flight.since[row] <= round_:
                new = tokens[row][1 if flight.traces[i].tokens else 0:]  # column 0: the first token, where unread
                flight.record(row, new, len(new), now, free)
        return now


def generate(target: BatchTarget, prompts: list[list[int]], max_new_tokens: int, stop_ids, concurrency: int,
             sampling: Sampling | None = None, seeds: list[int] | None = None, steps: int = 1,
             progress=None) -> list[tuple[list[int], str]]:
    """Target-only answers (tokens without the stop token, "stop" or "length") to every prompt, in order, with
    `concurrency` rows in flight (`serve` with NoDrafts): the longest prompts first, a prompt's repeats (its samples)
    side by side, so that one prefill serves them."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if not prompts:
        return []
    stops = set(stop_ids)
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), prompts[i], i))
    traces = serve(target, NoDrafts(), [prompts[i] for i in order], concurrency, 1, max_new_tokens, stops, sampling,
                   [seeds[i] for i in order], steps, progress, every_row=True)
    answers: list = [None] * len(prompts)
    for i, trace in zip(order, traces):
        stopped = bool(trace.tokens) and trace.tokens[-1] in stops
        answers[i] = (trace.tokens[:-1], "stop") if stopped else (trace.tokens, "length")
    return answers
