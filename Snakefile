# draftsmith: raw chat data -> hidden-state shards -> vocab map -> EAGLE-3 draft -> benchmark -> report.
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

from draftsmith import results_lock
from draftsmith.fingerprints import other_workdir, record_run

min_version("9.0")


configfile: f"{workflow.basedir}/config/config.yaml"


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/preflight.smk"
include: "rules/extract.smk"
include: "rules/vocab.smk"
include: "rules/train.smk"
include: "rules/benchmark.smk"
include: "rules/report.smk"
include: "rules/validate.smk"


# One run at a time per results tree (draftsmith/results_lock.py): Snakemake's own lock is per working
# directory. Held by the main process from its first job to its exit. Snakemake runs no hooks in a dry
# run, under --lint or in the jobs it spawns (--no-hooks); is_main_process guards the last once more.
# Then, before any job starts (Snakemake deletes a job's old outputs when it starts), the shard manifests
# that this run's jobs read but do not rebuild must parse: a truncated one stops the run here, naming it and
# the command that rebuilds the shard, instead of failing train_draft after its last good draft is deleted.
onstart:
    if workflow.is_main_process:
        # a run from another working directory would not see Snakemake's records of how each output was made
        if other_workdir(R):
            raise WorkflowError(
                f"results: {R} was made from the working directory {other_workdir(R)}, where Snakemake keeps its "
                "records of how each output was made; run Snakemake there, or give another results directory. "
                "No job was started."
            )
        try:
            results_lock.acquire(R)
        except results_lock.ResultsLockedError as e:
            raise WorkflowError(str(e)) from None
        # a read-only tree: one line, not Snakemake's traceback
        except OSError as e:
            raise WorkflowError(
                f"results: {R} cannot be written ({e.strerror}: {e.filename}); a run writes its lock and logs there. "
                f"`draftsmith validate {R}` checks a read-only tree without writing to it"
            ) from None
        from draftsmith.extraction import shards

        jobs = list(workflow.dag.needrun_jobs())
        problems = shards.unreadable_manifests(
            shards.manifests_read_not_made(jobs, R / "shards")
        )
        # the jobs run here: every GPU count they ask for must exist before the first one starts
        if workflow.local_exec:
            problems += gpu_problems({job.rule.name for job in jobs})
        if problems:
            results_lock.release(R)
            raise WorkflowError("\n".join([*problems, "No job was started."]))
        # the working directory and config files of this run: `draftsmith validate` reads them when given no config
        record_run(
            R, [str(f) for f in workflow.overwrite_configfiles or []], config
        )


onsuccess:
    results_lock.release(R)


onerror:
    results_lock.release(R)


rule all:
    default_target: True
    input:
        all_outputs(),
