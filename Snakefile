# draftsmith: raw chat data -> hidden-state shards -> vocab map -> EAGLE-3 draft -> benchmark -> report.
from snakemake.utils import min_version

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


rule all:
    default_target: True
    input:
        all_outputs(),
