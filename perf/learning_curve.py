"""The learning curve of a results tree as CSV: one row per variant (its data_fraction and training tokens, validation
accuracy per TTT step, the acceptance length those predict, and the benchmark's measured acceptance and speedup).

It reads each benchmarked variant's `benchmark/{variant}/summary.json` and its draft's `metrics.csv` and
`training_data.json` (no GPU needed: a finished run); the report's `learning_curve.csv` is the same table
(draftsmith.report.learning_curve).

    python perf/learning_curve.py --results results-gpu --out perf/results/smollm2_h200_learning_curve.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.report.learning_curve import from_results, write_csv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True, help="a results directory (config `results:`)")
    ap.add_argument("--out", required=True, help="the CSV to write")
    args = ap.parse_args(argv)
    curve = from_results(args.results)
    write_csv(curve, args.out)
    print(curve.round(4).to_markdown(index=False))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
