"""draftsmith: train and measure EAGLE-3 draft models with a reproducible Snakemake pipeline."""

__version__ = "0.1.0"
