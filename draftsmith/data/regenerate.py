"""Self-distillation data: the target answers each prompt, and its answers become the training replies.

An EAGLE-3 draft learns to predict the target's own next tokens, so replies written by the target
itself (rather than by whatever model wrote a dataset) match what it will be asked to speculate.

`regenerate` is one driver and two backends, as extraction is. The driver reads the prompts (and counts what it
drops), renders each with the target's chat template and a generation prompt to token ids (the same ids for every
backend), cuts them into resumable chunks, and writes the answers, their checks and the stats. A backend only turns
a chunk's requests (prompt token ids and a seed) into answers (token ids and a finish reason):

- `hf` (draftsmith.data.regenerate_hf): transformers `generate` in left-padded batches;
- `vllm` (draftsmith.data.regenerate_vllm): vLLM 0.16's offline `LLM` engine (continuous batching, tensor parallel).

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

Not every prompt read is answered; each one dropped is counted by reason in the stats, and one warning
gives the counts: a record without a usable prompt (an empty or whitespace-only turn is `empty_content`;
unreadable records have the reasons prepare_dataset uses), the same prompt as an earlier one
(`duplicate_prompt`, compared case-folded with whitespace collapsed: `prompt_text_key`), an MT-Bench
question (`mtbench_question`), prompts mostly in non-Latin scripts from a prompt set (`not_latin_script`),
prompts past `max_records` (`beyond_max_records`), prompts with no room for an answer within seq_length
(`prompt_too_long`) or within the vllm engine's max_model_len (`prompt_exceeds_max_model_len`). A repeated
prompt id is no reason: the record is answered under `id#2`, `id#3`, ... (`duplicate_record_ids`), as
prepare_dataset names repeated ids, so every answer names one prompt.
The stats (`records_read`, `prompts_dropped`, `dropped_by_reason`, `duplicate_prompts`,
`duplicate_record_ids`, `num_prompts`, the answers' finish reasons and tokens, the answer checks of
draftsmith.data.answer_checks: cut at max_new_tokens, length percentiles, repetition; and the output's sha256) are
written to `<name>.stats.json` beside `<name>.jsonl`; prepare_dataset copies them into its stats.json
(key `regenerate`) while the sha256 matches the file it reads, and the report's data table shows them. Prompts the
target wrote itself (`source: self`, draftsmith.data.self_prompts) are read like a local file; the counts of the step
that wrote them come in through `extra_stats` (key `self_prompts`).

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
from collections import Counter
from pathlib import Path

from draftsmith.data.answer_checks import MOSTLY_CUT, answer_stats, is_repetitive
from draftsmith.io import read_json, read_jsonl, sha256_file, write_json, write_jsonl
from draftsmith.provenance import changed_keys
from draftsmith.target_model.spec import TargetSpec, stop_token_ids

log = logging.getLogger(__name__)


class PromptRecords(list):
    """Prompt records `{"id", "messages"}` to answer, in order, and what reading them dropped.

    `records_read`: records read from the raw data (for source fastchat, user turns); `dropped`: a Counter of
    the prompts read but not in the list, by reason; `duplicate_record_ids`: prompts whose id repeated an
    earlier prompt's (kept under `id#2`, `id#3`, ...). Every prompt read is either in the list or in `dropped`.
    `later_user_turns`: user turns after a record's first, which a prompt leaves out (the target answers the first).
    """

    def __init__(self, records=(), records_read: int | None = None, dropped=None, duplicate_record_ids: int = 0,
                 later_user_turns: int = 0):
        super().__init__(records)
        self.dropped = Counter({k: v for k, v in (dropped or {}).items() if v})
        self.records_read = len(self) + sum(self.dropped.values()) if records_read is None else records_read
        self.duplicate_record_ids = duplicate_record_ids
        self.later_user_turns = later_user_turns

    def keep(self, kept, reason: str) -> "PromptRecords":
        """A copy holding `kept` (some of these records, in order); the others are counted as dropped for `reason`."""
        kept = list(kept)
        out = PromptRecords(kept, self.records_read, self.dropped, self.duplicate_record_ids, self.later_user_turns)
        if len(self) > len(kept):
            out.dropped[reason] += len(self) - len(kept)
        return out

    def describe_drops(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) or "none"


def _unique_id(record_id: str, occurrence: int, used: set[str]) -> str:
    """`id` for the first record with that id, `id#N` for the N-th (bumped past ids already taken), as
    prepare_dataset names the samples of repeated ids."""
    n = occurrence
    unique = record_id if n == 1 else f"{record_id}#{n}"
    while unique in used:
        n += 1
        unique = f"{record_id}#{n}"
    return unique


def prompt_text_key(messages: list[dict]) -> tuple:
    """What makes two prompts the same for deduplication: every turn's role and content, the content
    case-folded with runs of whitespace collapsed to one space (punctuation, digits and symbols count, so
    "2+2?" and "2-2?" differ; a different system turn makes a different prompt)."""
    return tuple((m["role"], " ".join(m["content"].casefold().split())) for m in messages)


def _later_user_turns(data: dict) -> int:
    """User turns of a raw record after its first (a prompt is the first; the later ones are not answered)."""
    from draftsmith.data.chat_data import normalise

    try:
        turns = data["turns"] if "turns" in data else normalise(data, require_reply=False)
    except Exception:  # noqa: BLE001 - a record that yields a prompt but does not normalise has no later turns to count
        return 0
    users = [t for t in turns if isinstance(t, str) or t.get("role") == "user"]
    return max(0, len(users) - 1)


def _read_prompt_file(spec) -> tuple[list[tuple[str, dict]], int, Counter, int]:
    """(where, record) of each usable prompt of a JSONL path or dataset spec, the number of records read, the
    records skipped by reason (each logged, named by `line N` or `record N`), and the user turns left out after
    each prompt's first."""
    from draftsmith.data.prompts import iter_prompts

    entries, read, skipped, later = [], 0, Counter(), 0
    for raw, prompt in iter_prompts(spec):
        read += 1
        if isinstance(prompt, Exception):
            skipped[prompt.reason] += 1
            log.warning("regenerate: skipped %s: %s", raw.where, prompt)
            continue
        later += _later_user_turns(raw.data)
        entries.append((raw.where, {"id": prompt["prompt_id"], "messages": prompt["messages"]}))
    return entries, read, skipped, later


def _check_prompt_list(prompts) -> tuple[list[tuple[str, dict]], int, Counter, int]:
    """(where, record) of each record of a list whose prompt is not blank, the number read, blank ones by
    reason, duplicate ids already counted (a PromptRecords carries them). Malformed records raise."""
    entries, skipped = [], Counter()
    for i, rec in enumerate(prompts):
        msgs = rec.get("messages") if isinstance(rec, dict) else None
        rid = str(rec.get("id", rec.get("prompt_id", i))) if isinstance(rec, dict) else str(i)
        where = f"prompt record {i} (id {rid})"
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                            for m in msgs):
            raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
        if msgs[-1].get("role") != "user":
            raise ValueError(f"{where}: the last message must be a user turn")
        blank = next((j for j, m in enumerate(msgs) if not m["content"].strip()), None)
        if blank is not None:
            skipped["empty_content"] += 1
            log.warning("regenerate: skipped %s: messages[%d].content is empty", where, blank)
            continue
        entries.append((where, {"id": rid, "messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}))
    if isinstance(prompts, PromptRecords):
        return entries, prompts.records_read, prompts.dropped + skipped, prompts.duplicate_record_ids
    return entries, len(prompts), skipped, 0


def load_prompt_records(prompts) -> PromptRecords:
    """The prompts to answer as a PromptRecords (`[{"id", "messages"}]` plus what was dropped on the way),
    from a JSONL path or dataset spec (any format draftsmith.data.prompts reads) or a list of records (a
    PromptRecords keeps its counts).

    Each prompt is its system turns plus the first user turn (what draftsmith.data.prompts takes). Read in
    order, a record is
    - skipped, counted by reason, if it has no usable prompt (an empty or whitespace-only turn: `empty_content`;
      the reasons of draftsmith.data.chat_data for a file; a malformed record of a list raises instead);
    - kept under `id#N` if its id repeats an earlier prompt's (`duplicate_record_ids`; prepare_dataset
      does the same with sample ids), so that every answer names one prompt;
    - dropped as `duplicate_prompt` if it is the same prompt as an earlier one (`prompt_text_key`: case and
      whitespace aside), which would be answered twice and could land in both training and validation.
    """
    later = carried = 0
    if isinstance(prompts, dict):
        entries, read, dropped, later = _read_prompt_file(prompts)
        duplicate_ids, name = 0, prompts.get("path") or prompts.get("name")
    elif isinstance(prompts, (str, Path)):
        entries, read, dropped, later = _read_prompt_file(prompts)
        duplicate_ids, name = 0, str(prompts)
    else:
        entries, read, dropped, duplicate_ids = _check_prompt_list(prompts)
        name = "the prompt list"
        # counted (and warned) where the list was read from its file
        carried = getattr(prompts, "later_user_turns", 0)
    if later:
        log.warning("regenerate: %d user turns after the first of their record are left out of %s (the target "
                    "answers each record's first user turn)", later, name)
    if not read:
        raise ValueError(f"no prompts in {name}")
    out, used, occurrences = [], set(), Counter()
    first_id: dict[str, str] = {}
    first_text: dict[tuple, str] = {}
    for where, rec in entries:
        rid = rec["id"]
        occurrences[rid] += 1
        if rid in first_id:
            duplicate_ids += 1
            rec = {**rec, "id": _unique_id(rid, occurrences[rid], used)}
            log.warning("regenerate: %s: duplicate prompt id %r (first seen at %s); kept, as %r", where, rid,
                        first_id[rid], rec["id"])
        else:
            first_id[rid] = where
            if rid in used:  # an earlier duplicate was renamed to this id
                rec = {**rec, "id": _unique_id(rid, 2, used)}
        used.add(rec["id"])
        key = prompt_text_key(rec["messages"])
        if key in first_text:
            dropped["duplicate_prompt"] += 1
            # one line per duplicate at debug level (FastChat repeats 946 turns); the warning gives the count
            log.debug("regenerate: dropped %s: the same prompt as %s (case and whitespace aside)", where,
                      first_text[key])
            continue
        first_text[key] = where
        out.append(rec)
    return PromptRecords(out, read, dropped, duplicate_ids, later or carried)


def regeneration_prompts(spec: dict, source: str, benchmark_questions: str | Path | None = None) -> PromptRecords:
    """The training prompts of a dataset (load_prompt_records' rules), never a benchmark prompt: any whose user
    turn equals (case, spacing and punctuation aside) an MT-Bench turn is dropped (`mtbench_question`), and the
    count logged.

    FastChat's conversations (source=fastchat) give every user turn (their 500 identity chats hold 1000, 54
    distinct: the rest are dropped as `duplicate_prompt`); the packaged prompt sets
    (draftsmith.data.prompt_sets) give their prompts (those mostly in non-Latin scripts dropped as
    `not_latin_script`); other sources give each record's first user turn. `max_records` counts the prompts
    kept; for fastchat and the prompt sets, those past it are counted as `beyond_max_records` (other sources
    stop reading there). `benchmark_questions`: MT-Bench's question.jsonl (default: the packaged one; the workflow
    passes the file it resolved, so that a job in another environment, e.g. envs/vllm.yaml, needs no data package).
    """
    from draftsmith.data import mtbench, prompt_sets

    benchmark_turns = [t for q in mtbench.load_questions(benchmark_questions) for t in q["turns"]]
    limit = spec.get("max_records")
    if source == "fastchat":
        conversations = mtbench.load_conversations(spec["path"])
        turns = mtbench.training_prompts(conversations, dedupe=False)
        # training_prompts leaves out a turn without a word character ("", "?"): counted as empty_content
        read = sum(t["from"] in ("human", "user") for c in conversations for t in c["conversations"])
        records = load_prompt_records(PromptRecords(turns, read, {"empty_content": read - len(turns)}))
    elif source in prompt_sets.PROMPT_SETS:
        skipped: Counter = Counter()
        rows = prompt_sets.load_prompt_set(source, spec["path"], skipped=skipped)
        records = load_prompt_records(PromptRecords([{"id": r["id"], "messages": r["messages"]} for r in rows],
                                                    dropped=skipped))
    else:
        records = load_prompt_records(spec)
    banned = {mtbench.normalise_text(t) for t in benchmark_turns}
    kept = records.keep([r for r in records if not any(
        m["role"] == "user" and mtbench.normalise_text(m["content"]) in banned for m in r["messages"])],
        "mtbench_question")
    if len(kept) < len(records):
        log.warning("regenerate: dropped %d prompts of %s that are MT-Bench questions (the benchmark prompts)",
                    len(records) - len(kept), spec.get("path") or spec.get("name"))
    return kept.keep(kept[:limit], "beyond_max_records") if limit else kept


def regenerate_stats_path(out_jsonl: str | Path) -> Path:
    """Where regenerate writes its stats: `<name>.stats.json` beside `<name>.jsonl`."""
    out_jsonl = Path(out_jsonl)
    return out_jsonl.with_name(out_jsonl.name.removesuffix(".jsonl") + ".stats.json")


def read_regenerate_stats(jsonl_path: str | Path, writer: str = "regenerate") -> dict | None:
    """The stats regenerate (or `writer`, e.g. self_prompts, which keeps them the same way) wrote for `jsonl_path`,
    or None when there are none, or they describe another version of the file (sha256 differs: logged)."""
    path = regenerate_stats_path(jsonl_path)
    if not path.is_file():
        return None
    try:
        stats = read_json(path)
    except ValueError as e:  # written atomically, so only a hand-edited file gets here
        log.warning("%s is not readable (%s); %s's counts are left out of the stats", path, e, writer)
        return None
    if not isinstance(stats, dict) or stats.get("output_sha256") != sha256_file(jsonl_path):
        log.warning("%s does not describe %s as it is now (sha256 differs); %s's counts are left out of "
                    "the stats", path, jsonl_path, writer)
        return None
    return stats


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
    "hf": "draftsmith.data.regenerate_hf:HFBackend",
    "vllm": "draftsmith.data.regenerate_vllm:VllmBackend",
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
                    "training replies end mid-answer; raise regenerate.max_new_tokens", stats["cut_at_max_new_tokens"],
                    stats["num_answers"], 100 * stats["cut_share"], params["max_new_tokens"])
    if stats["empty_answers"]:
        log.warning("regenerate: the target answered %d of %d prompts with nothing (an end-of-turn token first); "
                    "prepare skips those records as empty_content", stats["empty_answers"], stats["num_answers"])
    return stats
