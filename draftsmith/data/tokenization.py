"""Apply the target's chat template and build loss masks over assistant tokens only.

The mask is built by construction, never by searching the rendered text for the content.
For each assistant turn k the conversation is rendered twice with the target's own chat
template: up to turn k with the generation prompt (what the model sees before it answers)
and up to and including turn k. The reply is the text between the two, and both must be
character prefixes of the whole rendered conversation (true for Llama-3, ChatML/SmolLM2,
Qwen2.5 and the embedded target); where they are not, the record is skipped as
`template_not_prefix_stable`, naming the turn. The whole text is tokenized once; a token is
masked in when its characters lie inside a reply, which ends with the last special token the
template emits after the content (`<|im_end|>`, `<|eot_id|>`, `<|end|>`), so the draft learns
where an answer ends; a newline the template writes after that token is not masked. A token
that spans the start of a reply (the header's newline merged with a reply that starts with
whitespace) is split there by tokenizing both halves, where that reproduces the text exactly
(byte-level BPE always does), else the record is skipped as `reply_starts_inside_a_token`.
If the template has `{% generation %}` markers, its own assistant mask
(`return_assistant_tokens_mask`) is used instead.

System, user and tool turns are never trained on. A turn the template raises on, or a
tool turn or tool call it drops, skips the record with a reason naming the role.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from draftsmith.data.chat_data import BadRecord, normalise, record_tools
from draftsmith.data.readers import iter_records
from draftsmith.io import atomic_path, write_json

log = logging.getLogger(__name__)

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False))
    return ids


class _Renderer:
    """Renders prefixes of one conversation with the target's chat template; failures become BadRecords."""

    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None):
        self.tokenizer, self.messages, self.tools = tokenizer, messages, tools

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2 TemplateError (raise_exception), TypeError, ...: name the turn
            self._raise_for_turn(len(messages), e)

    def _raise_for_turn(self, upto: int, error: Exception):
        """The first turn whose rendering fails is the one the template cannot take."""
        for j in range(upto):
            try:
                self.tokenizer.apply_chat_template(self.messages[: j + 1], tools=self.tools, tokenize=False)
            except Exception as e:
                role = self.messages[j]["role"]
                raise BadRecord(f"template_rejects_{role}", f"messages[{j}]: the chat template cannot render "
                                f"this {role} turn: {type(e).__name__}: {e}") from None
        raise BadRecord("template_error", f"the chat template failed on messages[:{upto}]: "
                        f"{type(error).__name__}: {error}") from None


def _check_rendered(render: _Renderer, messages: list[dict]) -> str:
    """Render the whole conversation; skip it if the template drops a tool turn or an assistant's tool calls."""
    text = render(messages)
    for j, m in enumerate(messages):
        if m["role"] == "tool":
            shorter = render(messages[:j]) if j else ""
            if len(render(messages[: j + 1])) <= len(shorter):
                raise BadRecord("template_drops_tool", f"messages[{j}]: the chat template renders nothing for this "
                                "tool turn")
        if m.get("tool_calls"):
            without = {k: v for k, v in m.items() if k != "tool_calls"}
            if render(messages[:j] + [without]) == render(messages[: j + 1]):
                raise BadRecord("template_drops_tool_calls", f"messages[{j}].tool_calls: the chat template does not "
                                "render tool calls, so this reply would be trained as empty")
    return text


def assistant_char_spans(render: _Renderer, text: str, messages: list[dict]) -> list[tuple[int, int, int]]:
    """(message index, start, end) of each assistant turn in `text`: from after the generation prompt
    to the end of the rendered turn (the end-of-turn token and anything after it included)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], add_generation_prompt=True)
        after = render(messages[: i + 1])
        if not (text.startswith(before) and text.startswith(after) and len(before) < len(after)):
            raise BadRecord("template_not_prefix_stable", f"messages[{i}]: the chat template renders the conversation "
                            "before this assistant turn (with generation prompt) or up to it differently from the "
                            "whole conversation, so the reply's tokens cannot be located exactly")
        spans.append((i, len(before), len(after)))
    return spans


def _split_straddling(tokenizer, text: str, ids: list[int], offsets: list[tuple[int, int]], cut: int,
                      message: int) -> None:
    """Make `cut` a token boundary: tokens spanning it (e.g. the header's '\\n' merged with a reply that
    starts with '\\n') are re-tokenized as the text before and after the cut, if that reproduces the text
    exactly; otherwise the record is skipped."""
    ends = [e for _, e in offsets]
    t = bisect.bisect_right(ends, cut)  # the first token ending after the cut (offsets are in text order)
    if t >= len(offsets) or offsets[t][0] >= cut:
        return
    first = last = t  # with every token that shares a character with them (a multi-byte character split)
    while first > 0 and offsets[first - 1][1] > offsets[first][0]:
        first -= 1
    while last + 1 < len(offsets) and offsets[last + 1][0] < offsets[last][1]:
        last += 1
    start, end = offsets[first][0], max(ends[first: last + 1])
    new_ids, new_offsets = [], []
    for lo, hi in ((start, cut), (cut, end)):
        enc = tokenizer(text[lo:hi], add_special_tokens=False, return_offsets_mapping=True)
        if tokenizer.decode(enc["input_ids"], clean_up_tokenization_spaces=False) != text[lo:hi]:
            raise BadRecord("reply_starts_inside_a_token", f"messages[{message}]: the reply's first characters "
                            f"share a token with the template's header ({text[start:end]!r}), and the tokenizer "
                            "cannot split it exactly")
        new_ids += enc["input_ids"]
        new_offsets += [(a + lo, b + lo) for a, b in enc["offset_mapping"]]
    ids[first: last + 1] = new_ids
    offsets[first: last + 1] = new_offsets


def _mask_from_spans(tokenizer, text: str, spans: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    for message, start, _ in reversed(spans):
        _split_straddling(tokenizer, text, ids, offsets, start, message)
    special = _special_ids(tokenizer)
    starts = [s for s, _ in offsets]
    mask = [0] * len(ids)
    for message, start, end in spans:
        first = bisect.bisect_left(starts, start)
        inside = []
        for t in range(first, len(ids)):
            s, e = offsets[t]
            if s >= end:
                break
            if e <= end and e > s:
                inside.append(t)
        ends = [t for t in inside if ids[t] in special]
        if not ends:
            raise BadRecord("no_end_of_turn_token", f"messages[{message}]: the chat template writes no special token "
                            "after this assistant turn, so where the reply ends cannot be marked")
        for t in inside:
            if t > ends[-1]:
                break
            mask[t] = 1
    return ids, mask


def tokenize_conversation(tokenizer, messages: list[dict], seq_length: int,
                          tools: list[dict] | None = None) -> tuple[list[int], list[int], bool]:
    """Return (input_ids, loss_mask, truncated) for one normalised conversation."""
    render = _Renderer(tokenizer, messages, tools)
    text = _check_rendered(render, messages)
    if GENERATION_MARKER.search(tokenizer.get_chat_template(tools=tools)):
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids, mask = _mask_from_spans(tokenizer, text, assistant_char_spans(render, text, messages))
    truncated = len(ids) > seq_length
    return ids[:seq_length], mask[:seq_length], truncated


def _sample_id(name: str, record_id: str, occurrence: int, used: set[str]) -> str:
    """`name/id`, or `name/id#N` for the N-th record with that id (bumped past ids already taken)."""
    n = occurrence
    sample_id = f"{name}/{record_id}" if n == 1 else f"{name}/{record_id}#{n}"
    while sample_id in used:
        n += 1
        sample_id = f"{name}/{record_id}#{n}"
    return sample_id


# More than this share of a dataset's records skipped: the console line says so (a format or template mismatch,
# rather than a few bad records).
SKIPPED_WARN_FRACTION = 0.10
CUT_ANSWER = "cut_answer"  # the skip reason of an answer cut at max_new_tokens, with keep_cut_answers: false


def skipped_summary(stats: dict, kept_stats: Path | None = None) -> list[str]:
    """Console lines for a dataset with skipped records (none without): the counts by reason on one line, and a
    warning line when more than SKIPPED_WARN_FRACTION of the records were skipped."""
    skipped, read = stats["records_skipped"], stats["records_read"]
    if not skipped:
        return []
    chosen = stats["skipped_by_reason"].get(CUT_ANSWER, 0)  # skipped as asked (keep_cut_answers: false), not bad data
    reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(stats["skipped_by_reason"].items(),
                                                                 key=lambda kv: (-kv[1], kv[0])))
    where = f"; counts in {kept_stats}" if kept_stats else ""
    named = "each skipped record but the cut answers" if chosen else "each skipped record"
    lines = [f"prepare_dataset {stats['dataset']}: {skipped} of {read} records skipped ({reasons}), "
             f"{stats['records_kept']} kept{where}; {named} is named in the rule's log"]
    if skipped - chosen > SKIPPED_WARN_FRACTION * read:
        lines.append(f"WARNING: dataset {stats['dataset']!r}: {100 * (skipped - chosen) / read:.0f}% of its records were skipped "
                     f"(more than {100 * SKIPPED_WARN_FRACTION:.0f}%): check that the data is ShareGPT `conversations` "
                     "or OpenAI `messages` records and that the target's chat template can render them")
    return lines


def prepare_dataset(spec: dict, tokenizer, seq_length: int, out_path: Path, stats_path: Path, name: str,
                    kept_stats_path: Path | None = None, console=None) -> dict:
    """Tokenize every usable record of `spec` into a Parquet file; write stats; return them.

    stats.json is written even when no record is usable (then this raises after writing it). When `spec` is a
    file that rule regenerate wrote (its stats beside it still match it), those stats are copied in under
    `regenerate`: the raw records read and the prompts dropped before answering, by reason.

    `kept_stats_path`: a copy of the stats that is not a declared output (rule prepare_dataset puts it beside its
    log), so that it survives a failed job, whose outputs Snakemake deletes. `console(lines)`: where the summary of
    skipped records goes besides the log (skipped_summary; rule prepare_dataset prints it on the console)."""
    skipped: Counter[str] = Counter()
    rows = {"sample_id": [], "input_ids": [], "loss_mask": []}
    read = truncated = tokens = assistant_tokens = duplicates = 0
    first_seen: dict[str, str] = {}
    occurrences: Counter[str] = Counter()
    used: set[str] = set()
    keep_cut = spec.get("keep_cut_answers", True)
    for raw in tqdm(iter_records(spec), desc=f"prepare {name}", mininterval=5, unit="rec"):
        read += 1
        where = raw.where
        if not keep_cut and isinstance(raw.data, dict) and raw.data.get("finish_reason") == "length":
            skipped[CUT_ANSWER] += 1  # as asked: an answer cut at regenerate.max_new_tokens (logged in the summary)
            continue
        occurrences[raw.record_id] += 1
        duplicate_of = first_seen.get(raw.record_id) if raw.has_own_id else None
        if raw.has_own_id and duplicate_of is None:
            first_seen[raw.record_id] = where
        duplicates += duplicate_of is not None
        try:
            if raw.data is None:
                raise BadRecord(raw.reason or "invalid_json", raw.error)
            messages = normalise(raw.data)
            ids, mask, was_truncated = tokenize_conversation(tokenizer, messages, seq_length, record_tools(raw.data))
            if not any(mask):
                raise BadRecord(
                    "no_assistant_tokens_in_window", f"no assistant token within the first {seq_length} tokens"
                )
        except BadRecord as e:
            skipped[e.reason] += 1
            log.warning("skipped %s: %s", where, e)
            if duplicate_of is not None:
                log.warning("%s: duplicate record id %r (first seen at %s)", where, raw.record_id, duplicate_of)
            continue
        truncated += was_truncated
        tokens += len(ids)
        assistant_tokens += sum(mask)
        sample_id = _sample_id(name, raw.record_id, occurrences[raw.record_id], used)
        used.add(sample_id)
        if duplicate_of is not None:
            log.warning("%s: duplicate record id %r (first seen at %s); ids are not a key here, so the record is "
                        "kept, as sample %r", where, raw.record_id, duplicate_of, sample_id)
        rows["sample_id"].append(sample_id)
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
    stats = {
        "dataset": name,
        "records_read": read,
        "records_kept": len(rows["sample_id"]),
        "records_skipped": sum(skipped.values()),
        "skipped_by_reason": dict(sorted(skipped.items())),
        "duplicate_record_ids": duplicates,
        "records_truncated": truncated,
        "tokens": tokens,
        "assistant_tokens": assistant_tokens,
        "seq_length": seq_length,
    }
    if spec["source"] == "local":
        from draftsmith.data.regenerated import read_regenerate_stats

        regenerated = read_regenerate_stats(spec["path"])
        if regenerated is not None:
            stats["regenerate"] = regenerated
    if duplicates:
        log.warning("%s: %d records repeat an earlier record's id; their sample ids carry a '#N' suffix", name,
                    duplicates)
    if kept_stats_path is not None:  # before anything can fail: this copy is what a failed job leaves
        write_json(kept_stats_path, stats)
    summary = skipped_summary(stats, kept_stats_path)
    for line in summary:
        log.warning("%s", line)
    if summary and console is not None:
        console(summary)
    if not rows["sample_id"]:
        # Written for the record, and logged too: Snakemake deletes a failed job's outputs, stats.json among them.
        write_json(stats_path, stats)
        log.error("%s: stats (written to %s): %s", name, stats_path, json.dumps(stats, sort_keys=True))
        if not read:
            raise ValueError(f"dataset {name!r}: {spec.get('path') or spec.get('name')} holds no records (an empty "
                             f"file or dataset); check datasets.{name}")
        raise ValueError(
            f"dataset {name!r} has no usable records ({read} read; skipped by reason: {dict(sorted(skipped.items())) or 'none'}); "
            "each skipped record is logged above with its file, line or record, and field, then the dataset's stats"
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
