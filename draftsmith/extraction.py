"""Extract one hidden-state shard with the configured backend."""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.io import sha256_file
from draftsmith.layers import resolve_aux_layer_ids
from draftsmith.models import load_text_config
from draftsmith.shards import extract_shard, model_fingerprint, validate_shard
from draftsmith.tokenization import read_samples

log = logging.getLogger(__name__)


def extract(samples_path, shard: int, shard_dir: Path, target: str, revision, trust_remote_code: bool, cfg: dict) -> dict:
    samples = read_samples(samples_path)
    config = load_text_config(target, trust_remote_code, revision)
    aux = resolve_aux_layer_ids(cfg.get("aux_layer_ids"), config.num_hidden_layers)
    model_info = {**model_fingerprint(target), "revision": revision, "model_type": config.model_type,
                  "num_hidden_layers": config.num_hidden_layers}
    backend = cfg.get("backend", "hf")
    log.info("extracting shard %d/%d of %s with the %s backend, aux layers %s", shard, cfg["num_shards"], samples_path, backend, aux)
    if backend == "hf":
        from draftsmith.hidden_states import HFHiddenStateExtractor

        extractor = HFHiddenStateExtractor(target, aux, cfg.get("device", "auto"), cfg.get("dtype", "auto"),
                                           trust_remote_code, revision)
        manifest = extract_shard(
            samples, sha256_file(samples_path), shard, cfg["num_shards"], shard_dir, extractor,
            batch_tokens=cfg.get("batch_tokens", 8192), max_batch_size=cfg.get("max_batch_size", 64),
            model_info=model_info, writers=cfg.get("writer_threads", 4),
        )
    elif backend == "vllm":
        from draftsmith.vllm_extraction import extract_shard_vllm

        manifest = extract_shard_vllm(samples, sha256_file(samples_path), shard, cfg, shard_dir, target, aux,
                                      model_info, trust_remote_code, revision=revision)
    else:
        raise ValueError(f"unknown extraction backend {backend!r}")
    validate_shard(shard_dir, samples, deep=True)
    log.info("shard %d: %d samples, %d tokens, %.0f tokens/s", shard, manifest["num_samples"], manifest["num_tokens"],
             manifest["tokens_per_second"] or 0)
    return manifest
