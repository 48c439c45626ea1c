"""Self-distillation data: the target answers each prompt, and its answers become the training replies.

An EAGLE-3 draft learns to predict the target's own next tokens, so replies written by the target
itself (rather than by whatever model wrote a dataset) match what it will be asked to speculate.

`regenerate` renders each prompt with the target's chat template and a generation prompt,
generates in left-padded batches until an eos token (the tokenizer's and the generation
config's, e.g. `<|im_end|>`) or `max_new_tokens`, and writes OpenAI-messages JSONL:
`{"id", "messages": [...prompt..., {"role": "assistant", "content": answer}], "finish_reason",
"num_new_tokens"}`, in prompt order. An empty answer (the target ends its turn at once) is kept, so
that the file stays one row per prompt, and counted (`empty_answers`); prepare skips it as `empty_content`.

Not every prompt read is answered; each one dropped is counted by reason in the stats, and one warning
gives the counts: a record without a usable prompt (an empty or whitespace-only turn is `empty_content`;
unreadable records have the reasons prepare_dataset uses), the same prompt as an earlier one
(`duplicate_prompt`, compared case-folded with whitespace collapsed: `prompt_text_key`), an MT-Bench
question (`mtbench_question`), prompts mostly in non-Latin scripts from a prompt set (`not_latin_script`),
prompts past `max_records` (`beyond_max_records`), and prompts with no room for an answer within seq_length
(`prompt_too_long`). A repeated prompt id is no reason: the record is answered under `id#2`, `id#3`, ...
(`duplicate_record_ids`), as prepare_dataset names repeated ids, so every answer names one prompt.
The stats (`records_read`, `prompts_dropped`, `dropped_by_reason`, `duplicate_prompts`,
`duplicate_record_ids`, `num_prompts`, the answers' finish reasons and tokens, and the output's sha256) are
written to `<name>.stats.json` beside `<name>.jsonl`; prepare_dataset copies them into its stats.json
(key `regenerate`) while the sha256 matches the file it reads, and the report's data table shows them.

Work is done in chunks of `chunk_size` prompts, each written atomically to
`<out>.chunks/chunk_NNNNN.jsonl` beside a manifest holding a fingerprint of the prompts, the
model files and every generation parameter (the prompts as answered: after the drops, with the ids made
unique). A rerun with the same fingerprint keeps the finished
chunks; a different fingerprint says what changed, discards them and recomputes. The chunk
directory is removed once the output is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections import Counter
from pathlib import Path

from draftsmith.io import read_json, read_jsonl, sha256_file, write_json, write_jsonl
from draftsmith.provenance import changed_keys
from draftsmith.target_model.spec import TargetSpec, stop_token_ids

log = logging.getLogger(__name__)


class PromptRecords(list):
    """Prompt records `{"id", "messages"}` to answer, in order, and what reading them dropped.

    `records_read`: records read from the raw data (for source fastchat, user turns); `dropped`: a Counter of
    the prompts read but not in the list, by reason; `duplicate_record_ids`: prompts whose id repeated an
    earlier prompt's (kept under `id#2`, `id#3`, ...). Every prompt read is either in the list or in `dropped`.
    """

    def __init__(self, records=(), records_read: int | None = None, dropped=None, duplicate_record_ids: int = 0):
        super().__init__(records)
        self.dropped = Counter({k: v for k, v in (dropped or {}).items() if v})
        self.records_read = len(self) + sum(self.dropped.values()) if records_read is None else records_read
        self.duplicate_record_ids = duplicate_record_ids

    def keep(self, kept, reason: str) -> "PromptRecords":
        """A copy holding `kept` (some of these records, in order); the others are counted as dropped for `reason`."""
        kept = list(kept)
        out = PromptRecords(kept, self.records_read, self.dropped, self.duplicate_record_ids)
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


def _read_prompt_file(spec) -> tuple[list[tuple[str, dict]], int, Counter]:
    """(where, record) of each usable prompt of a JSONL path or dataset spec, the number of records read, and
    the records skipped by reason (each logged, named by `line N` or `record N`)."""
    from draftsmith.data.prompts import iter_prompts

    entries, read, skipped = [], 0, Counter()
    for raw, prompt in iter_prompts(spec):
        read += 1
        if isinstance(prompt, Exception):
            skipped[prompt.reason] += 1
            log.warning("regenerate: skipped %s: %s", raw.where, prompt)
            continue
        entries.append((raw.where, {"id": prompt["prompt_id"], "messages": prompt["messages"]}))
    return entries, read, skipped


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
    if isinstance(prompts, dict):
        entries, read, dropped = _read_prompt_file(prompts)
        duplicate_ids, name = 0, prompts.get("path") or prompts.get("name")
    elif isinstance(prompts, (str, Path)):
        entries, read, dropped = _read_prompt_file(prompts)
        duplicate_ids, name = 0, str(prompts)
    else:
        entries, read, dropped, duplicate_ids = _check_prompt_list(prompts)
        name = "the prompt list"
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
    return PromptRecords(out, read, dropped, duplicate_ids)


def regeneration_prompts(spec: dict, source: str) -> PromptRecords:
    """The training prompts of a dataset (load_prompt_records' rules), never a benchmark prompt: any whose user
    turn equals (case, spacing and punctuation aside) an MT-Bench turn is dropped (`mtbench_question`), and the
    count logged.

    FastChat's conversations (source=fastchat) give every user turn (their 500 identity chats hold 1000, 54
    distinct: the rest are dropped as `duplicate_prompt`); the packaged prompt sets
    (draftsmith.data.prompt_sets) give their prompts (those mostly in non-Latin scripts dropped as
    `not_latin_script`); other sources give each record's first user turn. `max_records` counts the prompts
    kept; for fastchat and the prompt sets, those past it are counted as `beyond_max_records` (other sources
    stop reading there).
    """
    from draftsmith.data import mtbench, prompt_sets

    benchmark_turns = [t for q in mtbench.load_questions() for t in q["turns"]]
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


def read_regenerate_stats(jsonl_path: str | Path) -> dict | None:
    """The stats regenerate wrote for `jsonl_path`, or None when there are none, or they describe another
    version of the file (sha256 differs: logged)."""
    path = regenerate_stats_path(jsonl_path)
    if not path.is_file():
        return None
    try:
        stats = read_json(path)
    except ValueError as e:  # written atomically, so only a hand-edited file gets here
        log.warning("%s is not readable (%s); regenerate's counts are left out of the stats", path, e)
        return None
    if not isinstance(stats, dict) or stats.get("output_sha256") != sha256_file(jsonl_path):
        log.warning("%s does not describe %s as it is now (sha256 differs); regenerate's counts are left out of "
                    "the stats", path, jsonl_path)
        return None
    return stats


def fingerprint_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _generate_chunk(model, tokenizer, records: list[dict], params: dict, eos: list[int], seed: int, progress) -> list[dict]:
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    encoded = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in records]
    order = sorted(range(len(records)), key=lambda i: (-len(encoded[i]), i))  # similar lengths share a batch
    answers: dict[int, dict] = {}
    torch.manual_seed(seed)
    bs = params["batch_size"]
    sampling = {"do_sample": True, "temperature": params["temperature"], "top_p": params["top_p"],
                "top_k": params["top_k"]} if params["temperature"] > 0 else {"do_sample": False}
    for start in range(0, len(order), bs):
        rows = order[start: start + bs]
        width = max(len(encoded[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(encoded[i]):] = torch.tensor(encoded[i])
            mask[r, width - len(encoded[i]):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=params["max_new_tokens"], eos_token_id=eos, pad_token_id=pad, **sampling)
        for r, i in enumerate(rows):
            new = out[r, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in eos), None)
            tokens = new if cut is None else new[:cut]
            answers[i] = {
                "id": records[i]["id"],
                "messages": records[i]["messages"] + [
                    {"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)}],
                "finish_reason": "length" if cut is None else "stop",
                "num_new_tokens": len(tokens) + (cut is not None),
            }
        if progress is not None:
            progress.update(len(rows))
    return [answers[i] for i in range(len(records))]


def regenerate(prompts, target: TargetSpec | str | Path, out_jsonl: str | Path, max_new_tokens: int = 256,
               batch_size: int = 16, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
               chunk_size: int = 64, device: str = "cpu", dtype: str = "float32", threads: int | None = None,
               show_progress: bool = True, max_prompt_tokens: int | None = None) -> dict:
    """Answer every prompt with the target (a TargetSpec or a model directory); write OpenAI-messages
    JSONL to `out_jsonl` and its stats to `regenerate_stats_path(out_jsonl)`. Returns the stats.

    `prompts`: what load_prompt_records takes (regeneration_prompts' result keeps the counts of what it
    dropped). `max_prompt_tokens` (the workflow passes seq_length): a prompt whose chat-template rendering has
    at least this many tokens is dropped (`prompt_too_long`); training would truncate its answer away.
    Every prompt read is answered or counted in the stats' `dropped_by_reason`, and a warning gives the counts."""
    import torch
    from tqdm import tqdm

    if max_new_tokens < 1 or batch_size < 1 or chunk_size < 1:
        raise ValueError("max_new_tokens, batch_size and chunk_size must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if threads:
        torch.set_num_threads(threads)
    target = target if isinstance(target, TargetSpec) else TargetSpec(str(target))
    records = load_prompt_records(prompts)
    if max_prompt_tokens is not None and records:
        tokenizer = target.load_tokenizer()
        fits = records.keep([r for r in records if len(tokenizer.apply_chat_template(
            r["messages"], add_generation_prompt=True)) < max_prompt_tokens], "prompt_too_long")
        if len(fits) < len(records):
            log.info("regenerate: skipped %d of %d prompts of %d tokens or more (no room for an answer within "
                     "seq_length)", len(records) - len(fits), len(records), max_prompt_tokens)
        records = fits
    if records.dropped:
        log.warning("regenerate: %d of %d prompts read are not answered (%s)", sum(records.dropped.values()),
                    records.records_read, records.describe_drops())
    if not records:
        raise ValueError(f"nothing to regenerate: every one of the {records.records_read} prompts read was dropped "
                         f"(by reason: {records.describe_drops()})")
    out_jsonl = Path(out_jsonl)
    chunk_dir = out_jsonl.with_name(out_jsonl.name + ".chunks")
    params = {"max_new_tokens": int(max_new_tokens), "batch_size": int(batch_size), "temperature": float(temperature),
              "top_p": float(top_p), "top_k": int(top_k), "seed": int(seed), "chunk_size": int(chunk_size),
              "dtype": dtype}
    parts = {"prompts": hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest(),
             "model": fingerprint_of(target.fingerprint()), **params}
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

    chunks = [records[i: i + chunk_size] for i in range(0, len(records), chunk_size)]
    paths = [chunk_dir / f"chunk_{c:05d}.jsonl" for c in range(len(chunks))]

    def finished(c: int) -> bool:
        if not paths[c].is_file():
            return False
        return [r["id"] for r in read_jsonl(paths[c])] == [r["id"] for r in chunks[c]]

    todo = [c for c in range(len(chunks)) if not finished(c)]
    if len(todo) < len(chunks):
        log.info("regenerate: %d of %d chunks already done in %s", len(chunks) - len(todo), len(chunks), chunk_dir)
    if todo:
        tokenizer = target.load_tokenizer()
        model = target.load_causal_lm(getattr(torch, dtype)).to(device).eval()
        eos = sorted(stop_token_ids(tokenizer, model))
        progress = tqdm(total=sum(len(chunks[c]) for c in todo), desc="regenerate", unit="prompt",
                        disable=not show_progress)
        for c in todo:
            rows = _generate_chunk(model, tokenizer, chunks[c], params, eos, seed + c, progress)
            write_jsonl(paths[c], rows)
        progress.close()

    stats = {"records_read": records.records_read, "prompts_dropped": sum(records.dropped.values()),
             "dropped_by_reason": dict(sorted(records.dropped.items())),
             "duplicate_prompts": records.dropped["duplicate_prompt"],
             "duplicate_record_ids": records.duplicate_record_ids,
             "num_prompts": len(records), "chunks": len(chunks), "chunks_reused": len(chunks) - len(todo),
             "finish_reasons": {}, "new_tokens": 0, "empty_answers": 0, "fingerprint": fingerprint}

    def all_rows():
        for p in paths:
            for row in read_jsonl(p):
                stats["finish_reasons"][row["finish_reason"]] = stats["finish_reasons"].get(row["finish_reason"], 0) + 1
                stats["new_tokens"] += row["num_new_tokens"]
                stats["empty_answers"] += not row["messages"][-1]["content"].strip()
                yield row

    write_jsonl(out_jsonl, all_rows())
    # beside the output, naming it by checksum: prepare_dataset carries these counts into its stats.json only
    # while they describe the file it reads
    stats.update(output=out_jsonl.name, output_sha256=sha256_file(out_jsonl))
    write_json(regenerate_stats_path(out_jsonl), stats)
    shutil.rmtree(chunk_dir)
    log.info("regenerate: %d answers (%s), %d new tokens -> %s", len(records), stats["finish_reasons"],
             stats["new_tokens"], out_jsonl)
    if stats["empty_answers"]:
        log.warning("regenerate: the target answered %d of %d prompts with nothing (an end-of-turn token first); "
                    "prepare skips those records as empty_content", stats["empty_answers"], len(records))
    return stats
