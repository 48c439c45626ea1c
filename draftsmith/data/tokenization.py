"""Apply the target's chat template and build loss masks over assistant tokens only.

The mask is found from character spans: every assistant message's content is located in
the rendered conversation, and each token whose character offsets overlap it is masked in,
plus the end-of-turn special token that directly follows, so the draft learns where an
answer ends. This works with any chat template that copies message content verbatim.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from draftsmith.data.chat_data import BadRecord, iter_records, normalise
from draftsmith.io import atomic_path, write_json

log = logging.getLogger(__name__)


def assistant_char_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        content = message["content"]
        pos = text.find(content, cursor)
        if pos < 0:  # templates that trim content
            content = content.strip()
            pos = text.find(content, cursor)
        if pos < 0:
            raise BadRecord("template_mismatch", f"messages[{i}].content does not appear in the rendered chat template")
        if message["role"] == "assistant":
            spans.append((pos, pos + len(content)))
        cursor = pos + len(content)
    return spans


def tokenize_conversation(tokenizer, messages: list[dict], seq_length: int) -> tuple[list[int], list[int], bool]:
    """Return (input_ids, loss_mask, truncated) for one normalised conversation."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    spans = assistant_char_spans(text, messages)
    special = set(tokenizer.all_special_ids)
    mask = [0] * len(ids)
    span_i = 0
    for t, (start, end) in enumerate(offsets):
        while span_i < len(spans) and start >= spans[span_i][1]:
            # the first token after an assistant span: masked in if it is the end-of-turn token
            if ids[t] in special:
                mask[t] = 1
            span_i += 1
        if span_i < len(spans) and end > spans[span_i][0] and start < spans[span_i][1] and end > start:
            mask[t] = 1
    truncated = len(ids) > seq_length
    return ids[:seq_length], mask[:seq_length], truncated


def prepare_dataset(spec: dict, tokenizer, seq_length: int, out_path: Path, stats_path: Path, name: str) -> dict:
    """Tokenize every usable record of `spec` into a Parquet file; write stats; return them."""
    skipped: Counter[str] = Counter()
    rows = {"sample_id": [], "input_ids": [], "loss_mask": []}
    read = truncated = tokens = assistant_tokens = 0
    for raw in tqdm(iter_records(spec), desc=f"prepare {name}", mininterval=5, unit="rec"):
        read += 1
        where = f"{raw.source}: record {raw.index} (id {raw.record_id})"
        try:
            if raw.data is None:
                raise BadRecord("invalid_json", raw.error)
            messages = normalise(raw.data)
            ids, mask, was_truncated = tokenize_conversation(tokenizer, messages, seq_length)
            if not any(mask):
                raise BadRecord(
                    "no_assistant_tokens_in_window", f"no assistant token within the first {seq_length} tokens"
                )
        except BadRecord as e:
            skipped[e.reason] += 1
            log.warning("skipped %s: %s", where, e)
            continue
        truncated += was_truncated
        tokens += len(ids)
        assistant_tokens += sum(mask)
        rows["sample_id"].append(f"{name}/{raw.record_id}")
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
    stats = {
        "dataset": name,
        "records_read": read,
        "records_kept": len(rows["sample_id"]),
        "records_skipped": sum(skipped.values()),
        "skipped_by_reason": dict(sorted(skipped.items())),
        "records_truncated": truncated,
        "tokens": tokens,
        "assistant_tokens": assistant_tokens,
        "seq_length": seq_length,
    }
    if not rows["sample_id"]:
        raise ValueError(
            f"dataset {name!r} has no usable records ({read} read; skipped by reason: {dict(sorted(skipped.items())) or 'none'}); "
            "each skipped record is logged above with its file, record and field"
        )
    table = pa.table(
        {
            "sample_id": pa.array(rows["sample_id"], pa.string()),
            "input_ids": pa.array(rows["input_ids"], pa.list_(pa.int32())),
            "loss_mask": pa.array(rows["loss_mask"], pa.list_(pa.int8())),
        }
    )
    with atomic_path(out_path, suffix=".parquet") as tmp:
        pq.write_table(table, tmp)
    write_json(stats_path, stats)
    return stats


def read_samples(path: str | Path) -> dict[str, list]:
    """Read a prepared-samples Parquet file into python lists."""
    table = pq.read_table(path)
    return {col: table.column(col).to_pylist() for col in ("sample_id", "input_ids", "loss_mask")}
