"""Where the pipeline's time went: each stage's jobs from Snakemake's benchmark files.

Every rule writes `benchmarks/<rule>.tsv` or `benchmarks/<rule>/<wildcards>.tsv` (Snakemake's `benchmark:`: the
job's wall seconds `s`, its peak resident memory `max_rss` in MB, ...). A stage is a rule: its jobs, their summed
and longest wall time, and the largest peak memory of any of them. The report rule's own file is written after the
report, so it is never among them; a file left by an earlier run of a job that has not run again is (the job's
outputs are current, so its time is still the time that built them).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

# the DAG's order, raw data first; a rule not named here follows them, by name
ORDER = ["preflight", "make_synthetic_corpus", "import_target", "build_target", "self_prompts", "regenerate",
         "prepare_dataset", "extract_hidden_states", "token_freq", "vocab_map", "train_draft", "benchmark_prompts",
         "benchmark"]
COLUMNS = ["stage", "jobs", "seconds", "longest job seconds", "peak memory MB"]


def read_benchmark_file(path: Path) -> dict:
    """The job's wall seconds and peak memory (MB; NaN where Snakemake could not measure it) from one benchmark
    file; a clear error naming the file where it is not one."""
    try:
        row = pd.read_csv(path, sep="\t").iloc[0]
        seconds = float(row["s"])
    except (KeyError, IndexError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise ValueError(f"{path}: not a Snakemake benchmark file (a header with column 's' and a row): {e}") from e
    rss = pd.to_numeric(pd.Series([row.get("max_rss", math.nan)]), errors="coerce").iloc[0]
    return {"seconds": seconds, "rss": float(rss)}


def stage_times(benchmarks: str | Path, job_files=None) -> pd.DataFrame:
    """One row per stage that left benchmark files under `benchmarks` (COLUMNS), in the DAG's order; empty where
    there are none (the folder missing too). `job_files`: the files of jobs with wildcards that count (relative to
    `benchmarks`, draftsmith.artefacts.job_benchmark_files); those of a variant renamed away do not."""
    root = Path(benchmarks)
    jobs = []
    for path in sorted(root.rglob("*.tsv")) if root.is_dir() else []:
        relative = path.relative_to(root)
        stage = relative.parts[0].removesuffix(".tsv")
        if job_files is not None and len(relative.parts) > 1 and str(relative) not in job_files:
            continue
        if stage != "report":
            jobs.append({"stage": stage, **read_benchmark_file(path)})
    if not jobs:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.DataFrame(jobs).groupby("stage").agg(jobs=("seconds", "size"), seconds=("seconds", "sum"),
                                                 longest=("seconds", "max"), peak=("rss", "max")).reset_index()
    df = df.rename(columns={"longest": "longest job seconds", "peak": "peak memory MB"})
    rank = {stage: i for i, stage in enumerate(ORDER)}
    df["_rank"] = df["stage"].map(lambda s: rank.get(s, len(ORDER)))
    return df.sort_values(["_rank", "stage"]).drop(columns="_rank").reset_index(drop=True)[COLUMNS]


def total_line(stages: pd.DataFrame) -> str | None:
    """A finding: the jobs' summed time from raw data to the benchmarked draft, and the longest stage."""
    if stages.empty:
        return None
    top = stages.loc[stages["seconds"].idxmax()]

    def jobs(n) -> str:
        return f"{int(n)} job{'' if int(n) == 1 else 's'}"

    return (f"From raw data to the benchmarked draft the jobs took {stages['seconds'].sum():,.0f} s in all "
            f"({jobs(stages['jobs'].sum())}; the run's wall time is less where jobs ran side by side); the "
            f"longest stage was {top['stage']} ({top['seconds']:,.0f} s, {jobs(top['jobs'])}).")
