import json
import logging
from pathlib import Path

from draftsmith.io import atomic_dir, write_json
from draftsmith.provenance import record_files
from draftsmith.smk import run, to_console
from draftsmith.target_model.embedded import build_embedded_target, corpus_mismatch_warning


def main(smk):
    # read from the run's config, not a param: the datasets do not change the target
    warning = corpus_mismatch_warning(smk.config["datasets"])
    if warning:
        logging.getLogger("draftsmith.target_model.embedded").warning(warning)
        to_console([f"WARNING: {warning}"])
    cfg = dict(smk.params.embedded_target)
    with open(smk.input.train) as f:
        conversations = [json.loads(line)["messages"] for line in f]
    with atomic_dir(smk.output[0]) as tmp:
        info = build_embedded_target(conversations, cfg, cfg["seed"], Path(tmp))
        write_json(Path(tmp) / "draftsmith_target.json", {"config": cfg, **info})
        record_files(tmp)


run(main, snakemake)  # noqa: F821
