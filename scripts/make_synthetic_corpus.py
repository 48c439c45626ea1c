from draftsmith.data.synthetic import generate_corpus
from draftsmith.io import write_jsonl
from draftsmith.smk import run


def main(smk):
    cfg = {"seed": 0, "num_records": 1200, "num_heldout": 40, **smk.params.synthetic}
    train, heldout = generate_corpus(cfg["num_records"], cfg["num_heldout"], cfg["seed"])
    write_jsonl(smk.output.heldout, heldout)
    write_jsonl(smk.output.train, train)


run(main, snakemake)  # noqa: F821
