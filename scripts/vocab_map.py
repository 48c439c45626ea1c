import logging

import torch

from draftsmith.io import torch_save
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec
from draftsmith.vocab import build_vocab_map, combine_frequencies, save_npy


def main(smk):
    freq = combine_frequencies([torch.load(p, weights_only=True) for p in smk.input.freqs])
    target_vocab = TargetSpec.from_dict(smk.params.target).load_text_config().vocab_size
    d2t, t2d = build_vocab_map(freq, smk.params.draft_vocab_size, target_vocab)
    covered = sum(c for t, c in freq.items() if t2d[t]) / max(1, sum(freq.values()))
    logging.getLogger("draftsmith.vocab").info(
        "draft vocab %d of %d target tokens covers %.2f%% of assistant tokens", len(d2t), target_vocab, 100 * covered
    )
    torch_save(freq, smk.output.combined)
    save_npy(smk.output.d2t, d2t)
    save_npy(smk.output.t2d, t2d)


run(main, snakemake)  # noqa: F821
