"""The report of a results tree that a run left unfinished (device time ran out before every variant was benchmarked):
the `report` rule needs every variant's outputs, this builds the same report from those that exist.

It reads what `perf/gpu/poll.sh` brings back (benchmark summaries and per-prompt rows, training metrics and
data summaries, dataset stats, rule benchmark files; draft configs and shard manifests where present) and the
run's config files, in the order the run was given them.

    python -m perf partial_report --results results-smollm2-50k --out report-partial \
        --configfile config/gpu-smollm2.yaml config/overlays/smollm2-50k.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith.config.workflow import load_config
from draftsmith.report.build import build_report
from perf.common import parser


def existing(paths) -> list[Path]:
    return [p for p in paths if p.exists()]


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--results", required=True, help="the results directory (config `results:`)")
    ap.add_argument("--configfile", nargs="+", required=True, help="the run's config files, in order")
    ap.add_argument("--out", required=True, help="directory for report.md, report.html, figures/, learning_curve.csv")
    args = ap.parse_args(argv)
    results, out = Path(args.results), Path(args.out)
    config = load_config(args.configfile)
    benchmarked = [v for v in config["variants"] if (results / "benchmark" / v / "summary.json").exists()]
    if not benchmarked:
        sys.exit(f"{results}: no variant has a benchmark summary (benchmark/<variant>/summary.json)")
    trained = [v for v in config["variants"] if (results / "draft" / v / "metrics.csv").exists()]
    build_report(
        summaries=[results / "benchmark" / v / "summary.json" for v in benchmarked],
        per_prompt=existing(results / "benchmark" / v / "per_prompt.csv" for v in benchmarked),
        metrics=[results / "draft" / v / "metrics.csv" for v in trained],
        drafts=existing(results / "draft" / v / "config.json" for v in trained),
        training_data=existing(results / "draft" / v / "training_data.json" for v in trained),
        stats=existing(results / "prepared" / d / "stats.json" for d in config["datasets"]),
        manifests=sorted(results.glob("shards/*/*/manifest.json")),
        config=config,
        out_html=out / "report.html",
        out_md=out / "report.md",
        figures_dir=out / "figures",
        out_csv=out / "learning_curve.csv",
        benchmarks=str(results / "benchmarks"),
    )
    missing = sorted(set(config["variants"]) - set(benchmarked))
    print(f"report of {', '.join(benchmarked)} written to {out}" + (f" (not benchmarked: {', '.join(missing)})" if missing else ""))


if __name__ == "__main__":
    main()
