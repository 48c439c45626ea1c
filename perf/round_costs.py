"""Where a benchmark's time went, per method, from its per_prompt.csv (no GPU needed: it reads a finished run).

For each method: milliseconds per target forward (a greedy step, or a speculative round with its share of the
prompt), split by whether the prompt's length occurs for the first time in the run (in prompt order). A cost that
only first-of-a-length prompts pay is a shape-dependent first call (a kernel plan, a capture) inside a timed
decode; the speedups over the other prompts show the run without it.

    python -m perf round_costs results-gpu/benchmark/default/per_prompt.csv --table perf/results/<run>.round_costs.md
"""

from __future__ import annotations

import pandas as pd

from draftsmith.benchmark.results import BASELINE
from draftsmith.io import write_text
from perf.common import parser


def round_costs(per_prompt: pd.DataFrame) -> pd.DataFrame:
    df = per_prompt.copy()
    prompts = df.drop_duplicates("prompt_id")  # in run order
    first = ~prompts["prompt_tokens"].duplicated()
    df["first_of_length"] = df["prompt_id"].map(dict(zip(prompts["prompt_id"], first)))
    df["ms_per_forward"] = 1e3 * df["seconds"] / df["target_forwards"]
    base = df[df["method"] == BASELINE].set_index("prompt_id")
    rows = []
    for method, g in df.groupby("method", sort=False):
        row = {"method": method, "prompts": len(g), "first-of-length prompts": int(g["first_of_length"].sum())}
        for label, part in (("first", g[g["first_of_length"]]), ("repeat", g[~g["first_of_length"]])):
            row[f"ms per forward, {label} (median)"] = part["ms_per_forward"].median()
        for label, part in (("all", g), ("repeat", g[~g["first_of_length"]])):
            b = base.loc[part["prompt_id"]]
            row[f"speedup, {label}"] = (part["new_tokens"].sum() / part["seconds"].sum()) / (
                b["new_tokens"].sum() / b["seconds"].sum())
        row["acceptance length"] = g["new_tokens"].sum() / g["target_forwards"].sum()
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("per_prompt", help="a benchmark's per_prompt.csv")
    ap.add_argument("--table", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    table = round_costs(pd.read_csv(args.per_prompt)).round(3).to_markdown(index=False)
    print(table)
    if args.table:
        write_text(args.table, f"`python -m perf round_costs {args.per_prompt}`\n\n{table}\n")


if __name__ == "__main__":
    main()
