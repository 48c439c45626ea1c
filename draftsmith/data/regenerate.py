"""Self-distillation data: the target answers each prompt, and its answers become the training replies.

An EAGLE-3 draft learns to predict the target's own next tokens, so replies written by the target
itself (rather than by whatever model wrote a dataset) match what it will be asked to speculate.

`regenerate` renders each prompt with the target's chat template and a generation prompt,
generates in left-padded batches until an eos token (the tokenizer's and the generation
config's, e.g. `<|im_end|>`) or `max_new_tokens`, and writes OpenAI-messages JSONL:
`{"id", "messages": [...prompt..., {"role": "assistant", "content": answer}], "finish_reason",
"num_new_tokens"}`, in prompt order. An empty answer (the target ends its turn at once) is kept, so
that the file stays one row per prompt, and counted (`empty_answers`); prepare skips it as `empty_content`.

Work is done in chunks of `chunk_size` prompts, each written atomically to
`<out>.chunks/chunk_NNNNN.jsonl` beside a manifest holding a fingerprint of the prompts, the
model files and every generation parameter. A rerun with the same fingerprint keeps the finished
chunks; a different fingerprint says what changed, discards them and recomputes. The chunk
directory is removed once the output is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from draftsmith.io import read_json, read_jsonl, write_json, write_jsonl
from draftsmith.provenance import changed_keys
from draftsmith.target_model.spec import TargetSpec, stop_token_ids

log = logging.getLogger(__name__)


def load_prompt_records(prompts) -> list[dict]:
    """`[{"id", "messages"}]` from a JSONL path or dataset spec (any format draftsmith.data.prompts reads)
    or a list of records.

    Each prompt is its system turns plus the first user turn (what draftsmith.data.prompts takes).
    """
    if isinstance(prompts, (str, Path, dict)):
        from draftsmith.data.prompts import load_prompts

        return [{"id": p["prompt_id"], "messages": p["messages"]} for p in load_prompts(prompts, None)]
    out, seen = [], set()
    for i, rec in enumerate(prompts):
        msgs = rec.get("messages") if isinstance(rec, dict) else None
        rid = str(rec.get("id", rec.get("prompt_id", i))) if isinstance(rec, dict) else str(i)
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                            for m in msgs):
            raise ValueError(f"prompt record {i} (id {rid}): field 'messages' must be a non-empty list of "
                             "{role, content} objects")
        if msgs[-1].get("role") != "user":
            raise ValueError(f"prompt record {i} (id {rid}): the last message must be a user turn")
        if rid in seen:
            raise ValueError(f"prompt record {i}: duplicate id {rid!r}")
        seen.add(rid)
        out.append({"id": rid, "messages": [{"role": m["role"], "content": m["content"]} for m in msgs]})
    if not out:
        raise ValueError("no prompts")
    return out


def regeneration_prompts(spec: dict, source: str) -> list[dict]:
    """The training prompts of a dataset, never a benchmark prompt: any whose user turn equals (case,
    spacing and punctuation aside) an MT-Bench turn is dropped, and the count logged.

    FastChat's conversations (source=fastchat) give every user turn, deduplicated (their 500
    identity chats hold 54 distinct ones); the packaged prompt sets (draftsmith.data.prompt_sets)
    give their prompts; other sources give each record's first user turn. `max_records` counts
    the prompts kept.
    """
    from draftsmith.data import mtbench, prompt_sets

    benchmark_turns = [t for q in mtbench.load_questions() for t in q["turns"]]
    limit = spec.get("max_records")
    if source == "fastchat":
        records = mtbench.training_prompts(mtbench.load_conversations(spec["path"]), exclude=benchmark_turns)
        return records[:limit] if limit else records
    banned = {mtbench.normalise_text(t) for t in benchmark_turns}
    if source in prompt_sets.PROMPT_SETS:
        records = [{"id": r["id"], "messages": r["messages"]} for r in prompt_sets.load_prompt_set(source, spec["path"])]
    else:
        records = load_prompt_records(spec)
    kept = [r for r in records
            if not any(m["role"] == "user" and mtbench.normalise_text(m["content"]) in banned for m in r["messages"])]
    if len(kept) < len(records):
        log.warning("regenerate: dropped %d prompts of %s that are MT-Bench questions (the benchmark prompts)",
                    len(records) - len(kept), spec.get("path") or spec.get("name"))
    return kept[:limit] if limit else kept


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
    JSONL to `out_jsonl`. Returns stats.

    `max_prompt_tokens` (the workflow passes seq_length): a prompt whose chat-template rendering has at
    least this many tokens is skipped, and the count logged; training would truncate its answer away."""
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
    if max_prompt_tokens is not None:
        tokenizer = target.load_tokenizer()
        fits = [r for r in records if len(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True))
                < max_prompt_tokens]
        if len(fits) < len(records):
            log.info("regenerate: skipped %d of %d prompts of %d tokens or more (no room for an answer within "
                     "seq_length)", len(records) - len(fits), len(records), max_prompt_tokens)
        if not fits:
            raise ValueError(f"every prompt has {max_prompt_tokens} tokens or more: nothing to regenerate")
        records = fits
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

    stats = {"num_prompts": len(records), "chunks": len(chunks), "chunks_reused": len(chunks) - len(todo),
             "finish_reasons": {}, "new_tokens": 0, "empty_answers": 0, "fingerprint": fingerprint}

    def all_rows():
        for p in paths:
            for row in read_jsonl(p):
                stats["finish_reasons"][row["finish_reason"]] = stats["finish_reasons"].get(row["finish_reason"], 0) + 1
                stats["new_tokens"] += row["num_new_tokens"]
                stats["empty_answers"] += not row["messages"][-1]["content"].strip()
                yield row

    write_jsonl(out_jsonl, all_rows())
    shutil.rmtree(chunk_dir)
    log.info("regenerate: %d answers (%s), %d new tokens -> %s", len(records), stats["finish_reasons"],
             stats["new_tokens"], out_jsonl)
    if stats["empty_answers"]:
        log.warning("regenerate: the target answered %d of %d prompts with nothing (an end-of-turn token first); "
                    "prepare skips those records as empty_content", stats["empty_answers"], len(records))
    return stats
