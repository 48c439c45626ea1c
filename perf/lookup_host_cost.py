"""Host time of prompt lookup under load: the proposers' incremental n-gram index against a scan of each row's whole
context, side by side on the same rows (CPU only: the lookup is host work in every backend).

B rows decode side by side; each starts from a prompt of --prompt-tokens tokens and gains 1 to k + 1 tokens a round
(a round's accepted drafts and bonus token) until --new-tokens; each round looks up every row's drafts both ways and
checks they are equal. Tokens are drawn from a Zipf law over SmolLM2's 49,152 ids (seeded): text-like repeats, not
real text. The table gives the host time per round of each way and their ratio.

    python -m perf lookup_host_cost --rows 16 64 --table perf/results/lookup_host_cost_cpu_<date>.md
"""

from __future__ import annotations

import random
import time

import numpy as np

from draftsmith.decoding.ngrams import ContextNgrams, prompt_lookup_candidates
from perf.common import commit, parser, write_table

VOCAB = 49152


def text_like(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) % VOCAB for t in rng.zipf(1.2, n)]


def measure(rows: int, prompt_tokens: int, new_tokens: int, k: int, max_ngram: int, seed: int) -> dict:
    rng, steps = np.random.default_rng(seed), random.Random(seed)
    contexts = [text_like(rng, prompt_tokens) for _ in range(rows)]
    index = ContextNgrams(max_ngram)
    scan_s = index_s = 0.0
    rounds = 0
    while len(contexts[0]) < prompt_tokens + new_tokens:
        start = time.perf_counter()
        scanned = [prompt_lookup_candidates(c, k, max_ngram) for c in contexts]
        middle = time.perf_counter()
        indexed = [index.candidates(row, c, k) for row, c in enumerate(contexts)]
        index_s += time.perf_counter() - middle
        scan_s += middle - start
        if scanned != indexed:
            raise AssertionError(f"round {rounds}: the index proposed other drafts than the scan")
        grow = steps.randint(1, k + 1)
        for c in contexts:
            c += text_like(rng, grow)
        rounds += 1
    return {"rows": rows, "rounds": rounds, "scan_ms_per_round": 1e3 * scan_s / rounds,
            "index_ms_per_round": 1e3 * index_s / rounds, "ratio": scan_s / index_s}


def main(argv=None):
    ap = parser(__doc__, table="lookup_host_cost_cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    results = [measure(r, args.prompt_tokens, args.new_tokens, args.k, args.max_ngram, args.seed) for r in args.rows]
    lines = [f"Prompt lookup's host time per decoding round, {args.prompt_tokens}-token prompts, {args.new_tokens} new "
             f"tokens, k = {args.k}, n-grams up to {args.max_ngram}, seed {args.seed}; commit {commit()}; the same "
             "drafts both ways, checked every round.", "",
             "| rows | rounds | scan ms/round | index ms/round | scan / index |", "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['rows']} | {r['rounds']} | {r['scan_ms_per_round']:.3f} | {r['index_ms_per_round']:.3f} | "
              f"{r['ratio']:.1f}x |" for r in results]
    write_table(args.table, "\n".join(lines) + "\n", {"args": vars(args), "results": results, "commit": commit()})


if __name__ == "__main__":
    main()
