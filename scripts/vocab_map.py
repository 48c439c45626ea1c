import logging

import torch

from draftsmith.io import torch_save
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec
from draftsmith.vocab import build_vocab_map, combine_frequencies, coverage_line, save_npy


def main(smk):
    freq = combine_frequencies([torch.load(p, weights_only=True) for p in smk.input.freqs])
    target_vocab = TargetSpec.from_dict(smk.params.target).load_text_config().vocab_size
    d2t, t2d = build_vocab_map(freq, smk.params.draft_vocab_size, target_vocab)
    logging.getLogger("draftsmith.vocab").info(coverage_line(freq, len(d2t), target_vocab))
    torch_save(freq, smk.output.combined)
    save_npy(smk.output.d2t, d2t)
    save_npy(smk.output.t2d, t2d)


run(main, snakemake)  # noqa: F821
