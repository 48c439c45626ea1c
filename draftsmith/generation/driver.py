"""Self-distillation data: the target answers each prompt, and its answers become the training replies.

An EAGLE-3 draft learns to predict the target's own next tokens, so replies written by the target
itself (rather than by whatever model wrote a dataset) match what it will be asked to speculate.

`regenerate` is one driver and two backends, as extraction is. The driver reads the prompts (and counts what it
drops), renders each with the target's chat template and a generation prompt to token ids (the same ids for every
backend), cuts them into resumable chunks, and writes the answers, their checks and the stats. A backend only turns
a chunk's requests (prompt token ids and a seed) into answers (token ids and a finish reason):

- `hf` (draftsmith.generation.hf_backend): transformers `generate` in left-padded batches;
- `vllm` (draftsmith.generation.vllm_backend): vLLM 0.16's offline `LLM` engine (continuous batching, tensor parallel).

Generation stops at an eos token (the tokenizer's and the generation config's, e.g. `<|im_end|>`) or at
`max_new_tokens`. The output is OpenAI-messages JSONL:
`{"id", "messages": [...prompt..., {"role": "assistant", "content": answer}], "finish_reason",
"num_new_tokens", "repetitive"}`, in prompt order. An empty answer (the target ends its turn at once) is kept, so
that the file stays one row per answer, and counted (`empty_answers`); prepare skips it as `empty_content`.

Greedy (temperature 0) answers once per prompt. Sampling seeds every answer by (seed, prompt id, sample index)
(`sample_seed`), so an answer never depends on the chunk, the batch or the backend's scheduling: chunk_size and
batch_size change how the work runs, not what it writes. `samples_per_prompt: n` (sampling only) answers each
prompt n times, as rows `<id>/s0` ... `<id>/s<n-1>`; an answer equal to an earlier answer to the same prompt is
dropped and counted (`duplicate_answers`).

Not every prompt read is answered: draftsmith.generation.prompt_records reads the prompts and counts each one
it drops by reason, and one warning gives the counts; prompts with no room for an answer within seq_length
(`prompt_too_long`) or within the vllm engine's max_model_len (`prompt_exceeds_max_model_len`) are dropped here.
The stats (`records_read`, `prompts_dropped`, `dropped_by_reason`, `duplicate_prompts`,
`duplicate_record_ids`, `num_prompts`, the answers' finish reasons and tokens, the answer checks of
draftsmith.data.answer_checks: cut at max_new_tokens, length percentiles, repetition; and the output's sha256) are
written to `<name>.stats.json` beside `<name>.jsonl` (draftsmith.data.regenerated); prepare_dataset copies them
into its stats.json (key `regenerate`) while the sha256 matches the file it reads, and the report's data table shows
them. Prompts the target wrote itself (`source: self`, draftsmith.generation.self_prompts) are read like a local
file; the counts of the step that wrote them come in through `extra_stats` (key `self_prompts`).

Work is done in chunks of `chunk_size` prompts, each written atomically to
`<out>.chunks/chunk_NNNNN.jsonl` beside a manifest holding a fingerprint of the prompts, the
model files, the backend and every setting that changes an answer (the prompts as answered: after the drops,
with the ids made unique). A rerun with the same fingerprint keeps the finished
chunks; a different fingerprint says what changed, discards them and recomputes. The chunk
directory is removed once the output is written.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import shutil
from pathlib import Path

from draftsmith.data.answer_checks import MOSTLY_CUT, answer_stats, is_repetitive
from draftsmith.data.regenerated import regenerate_stats_path
from draftsmith.generation.prompt_records import PromptRecords, load_prompt_records
from draftsmith.io import read_json, read_jsonl, sha256_file, write_json, write_jsonl
from draftsmith.provenance import changed_keys
from draftsmith.target_model.spec import TargetSpec, stop_token_ids

log = logging.getLogger(__name__)

def fingerprint_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- backends

# backend name -> "module:class"; imported only when chosen (the vllm backend imports vLLM). A backend turns a list of
# requests into answers and nothing else:
#     name: str; settings: dict (what else determines its answers: goes into the fingerprint and the stats)
#     prompt_limit(lengths, max_new_tokens) -> int | None    prompts of this many tokens or more cannot be answered
#     generate(requests, gen, progress) -> [{"token_ids", "finish_reason"}]   requests: [{"prompt_ids", "seed"}]
#     close()
BACKENDS = {
    "hf": "draftsmith.generation.hf_backend:HFBackend",
    "vllm": "draftsmith.generation.vllm_backend:VllmBackend",
}


class RegenerateSetupError(RuntimeError):
    """A setting regenerate cannot run with, found before any model loads."""


def engine_device(cfg: dict, target: TargetSpec) -> tuple[str, str]:
    """(device, dtype) a backend runs on, from regenerate's settings: hf resolves `auto` here; vLLM takes `auto`
    itself (bf16 for fp32 or bf16 checkpoints on a GPU) and picks its own device."""
    if cfg["backend"] != "hf":
        return "cpu", target.stage_dtype(cfg["dtype"])
    from draftsmith.devices import resolve_device, resolve_dtype

    device = resolve_device(cfg["device"])
    return str(device), str(resolve_dtype(target.stage_dtype(cfg["dtype"]), device)).removeprefix("torch.")


def make_backend(name: str, target: TargetSpec, cfg: dict):
    """The backend `name` for `target`; for vllm, the installed vLLM is checked first (metadata only), so that a
    missing or other vLLM fails with the command that installs it before anything imports it or loads a model."""
    if name not in BACKENDS:
        raise RegenerateSetupError(f"regenerate.backend: unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    if name == "vllm":
        from draftsmith.vllm_stack.installed import vllm_install_problem

        problem = vllm_install_problem()
        if problem:
            raise RegenerateSetupError(f"regenerate.backend: vllm: {problem}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(target, cfg)


def sample_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The seed of answer `sample` to the prompt `prompt_id`: a function of those alone (63 bits), so that a sampled
    answer does not depend on the chunk, the batch, the backend's scheduling or the other prompts."""
    digest = hashlib.sha256(f"{seed}\0{prompt_id}\0{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def answer_id(prompt_id: str, sample: int, samples_per_prompt: int) -> str:
    """The row id of an answer: the prompt's id, or `<id>/s<k>` when there are several per prompt (unique, since
    prompt ids are)."""
    return prompt_id if samples_per_prompt == 1 else f"{prompt_id}/s{sample}"


def check_samples_per_prompt(samples_per_prompt: int, temperature: float) -> None:
    if samples_per_prompt < 1:
        raise ValueError(f"regenerate.samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if samples_per_prompt > 1 and temperature == 0:
        raise ValueError(f"regenerate.samples_per_prompt: {samples_per_prompt} answers per prompt need sampling (with "
                         "temperature 0 every answer is the same); set regenerate.temperature above 0, or "
                         "samples_per_prompt: 1")


def _generate_chunk(backend, tokenizer, records: list[dict], prompt_ids: list[list[int]], gen: dict,
                    samples_per_prompt: int, progress) -> list[dict]:
    """The answer rows of one chunk: `samples_per_prompt` per record, in order (a record's samples together)."""
    requests = [{"prompt_ids": ids, "seed": sample_seed(gen["seed"], r["id"], k)}
                for r, ids in zip(records, prompt_ids) for k in range(samples_per_prompt)]
    answers = backend.generate(requests, gen, progress)
    if len(answers) != len(requests):
        raise RuntimeError(f"the {backend.name} backend returned {len(answers)} answers for {len(requests)} requests")
    rows = []
    for j, answer in enumerate(answers):
        record, k = records[j // samples_per_prompt], j % samples_per_prompt
        tokens = answer["token_ids"]
        rows.append({
            "id": answer_id(record["id"], k, samples_per_prompt),
            "messages": record["messages"] + [
                {"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)}],
            "finish_reason": answer["finish_reason"],
            "num_new_tokens": len(tokens) + (answer["finish_reason"] == "stop"),  # the stop token counts
            "repetitive": is_repetitive(tokens),
        })
    return rows


# ----------------------------------------------------------------------------- the driver


def regenerate(prompts, target: TargetSpec | str | Path, out_jsonl: str | Path, max_new_tokens: int = 256,
               batch_size: int = 16, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
               chunk_size: int = 64, device: str = "cpu", dtype: str = "float32", threads: int | None = None,
               show_progress: bool = True, max_prompt_tokens: int | None = None, backend="hf",
               samples_per_prompt: int = 1, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
               max_model_len: int | None = None, extra_stats: dict | None = None, attention: str = "ragged") -> dict:
    """Answer every prompt with the target (a TargetSpec or a model directory); write OpenAI-messages
    JSONL to `out_jsonl` and its stats to `regenerate_stats_path(out_jsonl)`. Returns the stats.

    `prompts`: what load_prompt_records takes (regeneration_prompts' result keeps the counts of what it
    dropped). `max_prompt_tokens` (the workflow passes seq_length): a prompt whose chat-template rendering has
    at least this many tokens is dropped (`prompt_too_long`); training would truncate its answer away.
    `backend`: "hf" (device, dtype, batch_size, attention), "vllm" (dtype, batch_size as max_num_seqs, tensor_parallel_size,
    gpu_memory_utilization, max_model_len: a longer prompt is dropped as `prompt_exceeds_max_model_len`), or a
    backend object (its settings are its own; it is not closed here).
    Every prompt read is answered or counted in the stats' `dropped_by_reason`, and a warning gives the counts.
    `extra_stats`: more sections for the stats file, e.g. `self_prompts` (the counts of the step that wrote the
    prompts)."""
    from tqdm import tqdm

    if max_new_tokens < 1 or batch_size < 1 or chunk_size < 1:
        raise ValueError("max_new_tokens, batch_size and chunk_size must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    check_samples_per_prompt(samples_per_prompt, temperature)
    if threads:
        import torch

        torch.set_num_threads(threads)
    target = target if isinstance(target, TargetSpec) else TargetSpec(str(target))
    owned = isinstance(backend, str)
    if owned:  # first: a backend that cannot run here fails before anything is read or loaded
        backend = make_backend(backend, target, {
            "device": device, "dtype": dtype, "batch_size": batch_size, "attention": attention,
            "tensor_parallel_size": tensor_parallel_size, "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": max_model_len})
    try:
        return _regenerate(prompts, target, Path(out_jsonl), backend, show_progress, max_prompt_tokens, chunk_size, {
            "max_new_tokens": int(max_new_tokens), "temperature": float(temperature), "top_p": float(top_p),
            "top_k": int(top_k), "seed": int(seed), "samples_per_prompt": int(samples_per_prompt), "dtype": dtype},
            tqdm, extra_stats or {})
    finally:
        if owned:
            backend.close()


def _drop_long(records: PromptRecords, prompt_ids: list, limit: int, reason: str, what: str):
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) < limit]
    if len(keep) == len(records):
        return records, prompt_ids
    log.info("regenerate: skipped %d of %d prompts of %d tokens or more (%s)", len(records) - len(keep),
             len(records), limit, what)
    return records.keep([records[i] for i in keep], reason), [prompt_ids[i] for i in keep]


def _regenerate(prompts, target: TargetSpec, out_jsonl: Path, backend, show_progress: bool,
                max_prompt_tokens: int | None, chunk_size: int, params: dict, tqdm, extra_stats: dict) -> dict:
    n = params["samples_per_prompt"]
    records = load_prompt_records(prompts)
    tokenizer = target.load_tokenizer()
    # one rendering for every backend: the chat template with the generation prompt, as token ids
    prompt_ids = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in records]
    if max_prompt_tokens is not None:
        records, prompt_ids = _drop_long(records, prompt_ids, max_prompt_tokens, "prompt_too_long",
                                         "no room for an answer within seq_length")
    limit = backend.prompt_limit([len(ids) for ids in prompt_ids], params["max_new_tokens"]) if records else None
    if limit is not None:
        records, prompt_ids = _drop_long(records, prompt_ids, limit, "prompt_exceeds_max_model_len",
                                         f"no room for an answer within the {backend.name} engine's max_model_len")
    if records.dropped:
        log.warning("regenerate: %d of %d prompts read are not answered (%s)", sum(records.dropped.values()),
                    records.records_read, records.describe_drops())
    if not records:
        raise ValueError(f"nothing to regenerate: every one of the {records.records_read} prompts read was dropped "
                         f"(by reason: {records.describe_drops()})")
    chunk_dir = out_jsonl.with_name(out_jsonl.name + ".chunks")
    # what determines the answers (not chunk_size or batch_size: each answer depends on its prompt and seed only)
    parts = {"format": 2, "prompts": hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest(),
             "model": fingerprint_of(target.fingerprint()), "backend": backend.name, **params, **backend.settings}
    fingerprint = fingerprint_of(parts)
    manifest_path = chunk_dir / "manifest.json"
    if manifest_path.is_file():
        old = read_json(manifest_path)
        if old.get("fingerprint") != fingerprint:
            log.warning("regenerate: %s holds chunks for other inputs (changed: %s); recomputing them", chunk_dir,
                        ", ".join(changed_keys(old.get("parts", {}), parts)) or "format")
            shutil.rmtree(chunk_dir)
    chunk_dir.mkdir(parents=True, exist_ok=True)
    write_json(manifest_path, {"fingerprint": fingerprint, "parts": parts, "num_prompts": len(records)})

    starts = range(0, len(records), chunk_size)
    chunks = [records[i: i + chunk_size] for i in starts]
    chunk_ids = [prompt_ids[i: i + chunk_size] for i in starts]
    paths = [chunk_dir / f"chunk_{c:05d}.jsonl" for c in range(len(chunks))]

    def expected_ids(c: int) -> list[str]:
        return [answer_id(r["id"], k, n) for r in chunks[c] for k in range(n)]

    def finished(c: int) -> bool:
        # a chunk file is kept whatever chunk_size wrote it, when it answers exactly this chunk's prompts
        return paths[c].is_file() and [r["id"] for r in read_jsonl(paths[c])] == expected_ids(c)

    todo = [c for c in range(len(chunks)) if not finished(c)]
    rows = getattr(backend, "batch_size", None)
    if todo and len(chunks) > 1 and rows and chunk_size * n < rows:  # each chunk is one call of the backend
        log.warning("regenerate: a chunk of %d prompts x %d answers keeps at most %d of the %s backend's %d rows busy; "
                    "regenerate.chunk_size %d or more fills them (a chunk is what an interrupted run keeps)",
                    chunk_size, n, chunk_size * n, backend.name, rows, -(-rows // n))
    if len(todo) < len(chunks):
        log.info("regenerate: %d of %d chunks already done in %s", len(chunks) - len(todo), len(chunks), chunk_dir)
    if todo:
        gen = {**params, "stop_ids": stop_token_ids(tokenizer, target.load_generation_config())}
        gen["pad_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sorted(gen["stop_ids"])[0]
        with tqdm(total=n * sum(len(chunks[c]) for c in todo), desc="regenerate", unit="answer",
                  disable=not show_progress) as bar:
            for c in todo:
                write_jsonl(paths[c], _generate_chunk(backend, tokenizer, chunks[c], chunk_ids[c], gen, n, bar.update))

    stats = {"records_read": records.records_read, "prompts_dropped": sum(records.dropped.values()),
             "dropped_by_reason": dict(sorted(records.dropped.items())),
             "duplicate_prompts": records.dropped["duplicate_prompt"],
             "duplicate_record_ids": records.duplicate_record_ids,
             "later_user_turns_dropped": records.later_user_turns,
             "num_prompts": len(records), "backend": backend.name, **backend.settings, "samples_per_prompt": n,
             "chunks": len(chunks), "chunks_reused": len(chunks) - len(todo),
             "num_answers": 0, "duplicate_answers": 0, "finish_reasons": {}, "new_tokens": 0, "empty_answers": 0,
             "fingerprint": fingerprint}
    if getattr(backend, "max_model_len", None) is not None:
        stats["max_model_len"] = backend.max_model_len
    kept: list[dict] = []

    def all_rows():
        for p in paths:
            rows = read_jsonl(p)
            for first in range(0, len(rows), n):  # one prompt's samples: the same answer twice is kept once
                seen = set()
                for row in rows[first: first + n]:
                    answer = row["messages"][-1]["content"]
                    if answer in seen:
                        stats["duplicate_answers"] += 1
                        continue
                    seen.add(answer)
                    stats["num_answers"] += 1
                    reasons = stats["finish_reasons"]
                    reasons[row["finish_reason"]] = reasons.get(row["finish_reason"], 0) + 1
                    stats["new_tokens"] += row["num_new_tokens"]
                    stats["empty_answers"] += not answer.strip()
                    kept.append({k: row[k] for k in ("finish_reason", "num_new_tokens", "repetitive")})
                    yield row

    write_jsonl(out_jsonl, all_rows())
    stats.update(answer_stats(kept))
    stats.update(extra_stats)
    # beside the output, naming it by checksum: prepare_dataset carries these counts into its stats.json only
    # while they describe the file it reads
    stats.update(output=out_jsonl.name, output_sha256=sha256_file(out_jsonl))
    write_json(regenerate_stats_path(out_jsonl), stats)
    shutil.rmtree(chunk_dir)
    log.info("regenerate: %d answers to %d prompts (%s), %d new tokens (p10/p50/p90 %s), %d repetitive -> %s",
             stats["num_answers"], len(records), stats["finish_reasons"], stats["new_tokens"],
             "/".join(str(v) for v in stats["new_tokens_percentiles"].values()), stats["repetitive_answers"], out_jsonl)
    if stats["duplicate_answers"]:
        log.info("regenerate: %d answers repeated an earlier answer to the same prompt and were dropped",
                 stats["duplicate_answers"])
    if stats["cut_share"] > MOSTLY_CUT:
        log.warning("regenerate: %d of %d answers (%.0f%%) were cut at max_new_tokens=%d (finish_reason length): most "
                    "training replies end mid-answer; raise regenerate.max_new_tokens, or train on the answers that end "
                    "(datasets.<name>.keep_cut_answers: false, with regenerate.samples_per_prompt above 1)",
                    stats["cut_at_max_new_tokens"], stats["num_answers"], 100 * stats["cut_share"],
                    params["max_new_tokens"])
    if stats["empty_answers"]:
        log.warning("regenerate: the target answered %d of %d prompts with nothing (an end-of-turn token first); "
                    "prepare skips those records as empty_content", stats["empty_answers"], stats["num_answers"])
    return stats
