"""The learning curve of a results tree as CSV: one row per variant (its data_fraction and training tokens, validation
accuracy per TTT step, the acceptance length those predict, and the benchmark's measured acceptance and speedup).

It reads each benchmarked variant's `benchmark/{variant}/summary.json` and its draft's `metrics.csv` and
`training_data.json` (no GPU needed: a finished run); the report's `learning_curve.csv` is the same table
(draftsmith.report.learning_curve).

    python -m perf learning_curve --results results-gpu --out perf/results/<name>_learning_curve.csv
"""

from __future__ import annotations

from draftsmith.report.learning_curve import from_results, write_csv
from perf.common import parser


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--results", required=True, help="a results directory (config `results:`)")
    ap.add_argument("--out", required=True, help="the CSV to write")
    args = ap.parse_args(argv)
    curve = from_results(args.results)
    write_csv(curve, args.out)
    print(curve.round(4).to_markdown(index=False))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
