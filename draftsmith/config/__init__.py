"""The workflow config outside Snakemake, and config/README.md generated from the schema."""
