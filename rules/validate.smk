# On demand: `snakemake validate` checks the whole results tree against the config: every output the config implies
# exists (prepared samples, shards, vocab map, drafts, benchmark results, report), each is intact, and each draft and
# benchmark was made from the current target, shards and vocab map. It has no output, so it runs every time it is
# asked; its verdict goes to the console and to the log.
rule validate:
    log:
        R / "logs" / "validate.log",
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=4000,
    params:
        # the user's config files: Snakemake's plan for them is checked, and each suggested command carries them
        configfiles=[str(f) for f in workflow.overwrite_configfiles or []],
    script:
        "../scripts/validate.py"


# Snakemake names each output of a results tree under the working directory relative to it (rules/common.smk): an
# absolute path into the tree on the command line would name no rule's output. This rule matches such a path only to
# say how to spell it.
if not R.is_absolute():

    rule absolute_path_into_results:
        input:
            lambda wc: respell(wc.path),
        output:
            os.path.join(os.path.realpath(R), "{path}"),
        localrule: True
