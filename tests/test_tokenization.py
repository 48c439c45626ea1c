import json

import pytest
from chat_templates import CHATML_TOKENS, QWEN25_TEMPLATE, SMOLLM2_TEMPLATE, with_template
from transformers import AutoTokenizer

from draftsmith.data.chat_data import BadRecord, normalise
from draftsmith.data.synthetic import generate_corpus
from draftsmith.data.tokenization import prepare_dataset, read_samples, tokenize_conversation
from draftsmith.target_model.embedded import train_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": " 3 + 3 = 6. "},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    train, _ = generate_corpus(200, 1, seed=0)
    texts = [m["content"] for r in train for m in r["messages"]]
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(texts, 400, out)
    return AutoTokenizer.from_pretrained(out)


def masked_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_loss_mask_covers_assistant_content_and_end_of_turn_only(tokenizer):
    ids, mask, truncated = tokenize_conversation(tokenizer, CONV, 512)
    assert not truncated and len(ids) == len(mask)
    assert masked_text(tokenizer, ids, mask) == "2 + 2 = 4.<|end|> 3 + 3 = 6. <|end|>"
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "What is 2 + 2?" in unmasked and "Be brief." in unmasked
    assert ids[0] == tokenizer.bos_token_id and mask[0] == 0


def test_loss_mask_with_a_template_that_trims_content(tokenizer):
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    ids, mask, _ = tokenize_conversation(tokenizer, CONV, 512)
    assert masked_text(tokenizer, ids, mask) == "2 + 2 = 4.<|im_end|>3 + 3 = 6.<|im_end|>"


def test_truncation_keeps_the_prefix(tokenizer):
    full_ids, full_mask, _ = tokenize_conversation(tokenizer, CONV, 512)
    ids, mask, truncated = tokenize_conversation(tokenizer, CONV, 20)
    assert truncated and ids == full_ids[:20] and mask == full_mask[:20]


def test_prepare_dataset_counts_kept_and_skipped_records(tokenizer, tmp_path, caplog):
    records = [
        {"id": "ok", "messages": CONV},
        {"id": "no-assistant", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "bad-role", "conversations": [{"from": "alien", "value": "hi"}]},
        {"id": "long", "messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "y"}]},
        {"id": "str", "messages": "hi"},
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(("\n".join(json.dumps(r) for r in records) + "\n{broken\n[1]\n").encode() + b"\xff\n")
    with caplog.at_level("WARNING"):
        stats = prepare_dataset({"source": "local", "path": str(path)}, tokenizer, 64, tmp_path / "s.parquet",
                                tmp_path / "stats.json", name="mix")
    assert stats["records_read"] == 8 and stats["records_kept"] == 1 and stats["records_skipped"] == 7
    assert stats["skipped_by_reason"] == {"conversation_not_a_list": 1, "invalid_json": 1, "invalid_utf8": 1,
                                          "no_assistant_tokens_in_window": 1, "no_assistant_turn": 1,
                                          "not_an_object": 1, "unknown_role": 1}
    assert stats["duplicate_record_ids"] == 0
    samples = read_samples(tmp_path / "s.parquet")
    assert samples["sample_id"] == ["mix/ok"]
    assert stats["tokens"] == len(samples["input_ids"][0]) and stats["assistant_tokens"] == sum(samples["loss_mask"][0])
    assert json.loads((tmp_path / "stats.json").read_text()) == stats
    # every skip names the file, the 1-based line and the field
    for skip in ("line 3 (id bad-role): conversations[0].from = 'alien' is not a known role",
                 "line 5 (id str): field 'messages' is a str, not a list of turns",
                 "line 6: invalid JSON",
                 "line 7: a JSON array, not a JSON object",
                 "line 8: invalid UTF-8 (byte 0xff at byte 1 of the line)"):
        assert f"skipped {path}: {skip}" in caplog.text


def test_keep_cut_answers_false_skips_the_answers_cut_at_max_new_tokens(tokenizer, tmp_path, caplog):
    """Regenerated answers (finish_reason stop or length): with keep_cut_answers false the cut ones are skipped as
    cut_answer, by choice (no warning about bad data, however many), and records without a finish_reason are kept."""
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    records = [{"id": f"r{i}", "messages": reply, "finish_reason": reason}
               for i, reason in enumerate(["length", "stop", "length", "length", "stop"])]
    records.append({"id": "raw", "messages": reply})
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = {"source": "local", "path": str(path)}
    kept_all = prepare_dataset(spec, tokenizer, 64, tmp_path / "all.parquet", tmp_path / "all.json", name="d")
    assert kept_all["records_kept"] == 6 and kept_all["records_skipped"] == 0
    lines = []
    with caplog.at_level("WARNING"):
        stats = prepare_dataset({**spec, "keep_cut_answers": False}, tokenizer, 64, tmp_path / "s.parquet",
                                tmp_path / "s.json", name="d", console=lines.extend)
    assert stats["records_kept"] == 3 and stats["skipped_by_reason"] == {"cut_answer": 3}
    assert read_samples(tmp_path / "s.parquet")["sample_id"] == ["d/r1", "d/r4", "d/raw"]
    assert lines == ["prepare_dataset d: 3 of 6 records skipped (cut_answer: 3), 3 kept; each skipped record but the "
                     "cut answers is named in the rule's log"]  # half skipped, as asked: no warning


def test_duplicate_record_ids_are_kept_under_unique_sample_ids(tokenizer, tmp_path, caplog):
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    records = [{"id": "a", "messages": reply}, {"id": "a", "messages": reply}, {"id": "a#2", "messages": reply},
               {"id": "b", "messages": [{"role": "user", "content": "hi"}]}, {"id": "b", "messages": reply},
               {"messages": reply}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with caplog.at_level("WARNING"):
        stats = prepare_dataset({"source": "local", "path": str(path)}, tokenizer, 64, tmp_path / "s.parquet",
                                tmp_path / "stats.json", name="d")
    assert stats["duplicate_record_ids"] == 2 and stats["records_kept"] == 5
    assert read_samples(tmp_path / "s.parquet")["sample_id"] == ["d/a", "d/a#2", "d/a#2#2", "d/b#2", "d/line 6"]
    assert (f"{path}: line 2 (id a): duplicate record id 'a' (first seen at {path}: line 1 (id a)); ids are not a "
            "key here, so the record is kept, as sample 'd/a#2'") in caplog.text
    assert "d: 2 records repeat an earlier record's id" in caplog.text


def test_dataset_without_usable_records_still_writes_its_stats(tokenizer, tmp_path, caplog):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    error = r"no usable records \(1 read; skipped by reason: \{'no_assistant_turn': 1\}\)"
    with pytest.raises(ValueError, match=error), caplog.at_level("ERROR"):
        prepare_dataset({"source": "local", "path": str(path)}, tokenizer, 64, tmp_path / "s.parquet",
                        tmp_path / "stats.json", name="empty")
    # also in the log, since Snakemake removes a failed job's outputs
    assert f"empty: stats (written to {tmp_path / 'stats.json'}): " in caplog.text and '"records_read": 1' in caplog.text
    assert not (tmp_path / "s.parquet").exists()
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["records_read"] == 1 and stats["records_kept"] == 0
    assert stats["skipped_by_reason"] == {"no_assistant_turn": 1}
    assert not list(tmp_path.glob(".stats.json*"))  # written atomically: no temporary left behind



def records_with_skips(path, kept: int, skipped: int):
    """`kept` usable records, then `skipped` without an assistant turn."""
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = [{"id": f"ok{i}", "messages": reply} for i in range(kept)]
    rows += [{"id": f"q{i}", "messages": [{"role": "user", "content": "hi"}]} for i in range(skipped)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"source": "local", "path": str(path)}


@pytest.mark.parametrize(("kept", "skipped", "warned"), [(160, 40, True), (190, 10, False), (200, 0, None)])
def test_skipped_records_print_one_console_line_and_a_warning_above_ten_percent(tokenizer, tmp_path, kept, skipped,
                                                                                warned):
    """40 of 200 records skipped exited 0 with nothing on the console: now one line with the counts by reason, and a
    warning line when more than 10% were skipped; nothing when none were. The counts also go to a copy of the stats
    that is not a declared output."""
    printed = []
    spec = records_with_skips(tmp_path / "in.jsonl", kept, skipped)
    copy = tmp_path / "logs" / "d.stats.json"
    stats = prepare_dataset(spec, tokenizer, 64, tmp_path / "s.parquet", tmp_path / "stats.json", name="d",
                            kept_stats_path=copy, console=printed.append)
    assert json.loads(copy.read_text()) == stats
    if warned is None:
        assert printed == []
        return
    (lines,) = printed
    assert lines[0] == (f"prepare_dataset d: {skipped} of 200 records skipped (no_assistant_turn: {skipped}), "
                        f"{kept} kept; counts in {copy}; each skipped record is named in the rule's log")
    if warned:
        assert len(lines) == 2 and lines[1].startswith("WARNING: dataset 'd': 20% of its records were skipped "
                                                       "(more than 10%)")
    else:
        assert len(lines) == 1


def test_a_dataset_without_usable_records_keeps_its_counts_outside_the_declared_outputs(tokenizer, tmp_path):
    printed = []
    spec = records_with_skips(tmp_path / "in.jsonl", 0, 3)
    copy = tmp_path / "logs" / "d.stats.json"
    with pytest.raises(ValueError, match="has no usable records"):
        prepare_dataset(spec, tokenizer, 64, tmp_path / "s.parquet", tmp_path / "stats.json", name="d",
                        kept_stats_path=copy, console=printed.extend)
    assert json.loads(copy.read_text())["skipped_by_reason"] == {"no_assistant_turn": 3}
    assert printed[0].startswith("prepare_dataset d: 3 of 3 records skipped (no_assistant_turn: 3), 0 kept")
    assert printed[1].startswith("WARNING: dataset 'd': 100% of its records were skipped")


TOOL_RECORD = {
    "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather for a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}],
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
        {"role": "assistant", "content": "It is -3 C in Oslo."},
    ],
}


def test_tool_calls_are_trained_on_and_tool_results_are_not_with_a_tool_template(tokenizer):
    from draftsmith.data.chat_data import record_tools

    qwen = with_template(tokenizer, QWEN25_TEMPLATE, CHATML_TOKENS)
    ids, mask, _ = tokenize_conversation(qwen, normalise(TOOL_RECORD), 4096, record_tools(TOOL_RECORD))
    assert masked_text(qwen, ids, mask) == ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
                                            "</tool_call><|im_end|>It is -3 C in Oslo.<|im_end|>")
    unmasked = qwen.decode([t for t, m in zip(ids, mask) if not m])
    assert "<tool_response>\n-3 C\n</tool_response>" in unmasked and '"name": "weather", "description"' in unmasked


def test_tool_turns_render_but_are_not_trained_on_with_the_embedded_template(tokenizer):
    messages = normalise({"messages": [*CONV[:3], {"role": "function", "name": "calc", "content": "4"},
                                       {"role": "assistant", "content": "Confirmed: 4."}]})
    ids, mask, _ = tokenize_conversation(tokenizer, messages, 512)
    assert masked_text(tokenizer, ids, mask) == "2 + 2 = 4.<|end|>Confirmed: 4.<|end|>"
    with pytest.raises(BadRecord) as e:  # the embedded template has no notion of tool calls
        tokenize_conversation(tokenizer, normalise(TOOL_RECORD), 512)
    assert e.value.reason == "template_drops_tool_calls" and "messages[1].tool_calls" in str(e.value)


def templated(tokenizer, template):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = template
    return tok


LOOP = "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
GEN = "{% if add_generation_prompt %}<|assistant|>{% endif %}"


@pytest.mark.parametrize("template, messages, reason, where", [
    # an end-of-conversation token after the last turn: earlier turns are not prefixes of the whole
    (LOOP + "{% if not add_generation_prompt %}<|eos|>{% endif %}" + GEN, CONV, "template_not_prefix_stable",
     "messages[2]"),
    # Gemma-style: no system role
    ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
     + LOOP + GEN, CONV, "template_rejects_system", "System role not supported"),
    # a template that silently leaves tool turns out
    ("{{ bos_token }}{% for m in messages %}{% if m['role'] != 'tool' %}{{ '<|' + m['role'] + '|>' + m['content'] "
     "+ '<|end|>' }}{% endif %}{% endfor %}" + GEN,
     CONV[:3] + [{"role": "tool", "content": "4"}, {"role": "assistant", "content": "ok"}], "template_drops_tool",
     "messages[3]"),
    # turns that end with plain text: where a reply ends cannot be marked
    ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
     "{% if add_generation_prompt %}assistant: {% endif %}", CONV, "no_end_of_turn_token", "messages[2]"),
])
def test_templates_that_cannot_be_masked_exactly_skip_the_record(tokenizer, template, messages, reason, where):
    with pytest.raises(BadRecord) as e:
        tokenize_conversation(templated(tokenizer, template), normalise({"messages": messages}), 512)
    assert e.value.reason == reason and where in str(e.value)


def test_generation_markers_give_the_templates_own_mask(tokenizer):
    marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
              "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
              "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = with_template(tokenizer, marked, CHATML_TOKENS)
    ids, mask, _ = tokenize_conversation(tok, CONV, 512)
    assert masked_text(tok, ids, mask) == "2 + 2 = 4.<|im_end|> 3 + 3 = 6. <|im_end|>"
    plain = with_template(tokenizer, SMOLLM2_TEMPLATE.replace(
        "{% if loop.first and messages[0]['role'] != 'system' %}", "{% if false %}"), CHATML_TOKENS)
    assert tokenize_conversation(plain, CONV, 512) == (ids, mask, False)  # the prefix method agrees


def test_a_reply_that_starts_inside_the_headers_last_token_is_split_there(tmp_path):
    train, _ = generate_corpus(40, 1, seed=0)
    train_tokenizer([m["content"] for r in train for m in r["messages"]] + ["a\n\n\nb"] * 50, 420, tmp_path)
    tok = with_template(AutoTokenizer.from_pretrained(tmp_path), SMOLLM2_TEMPLATE, CHATML_TOKENS)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    whole = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    start = text.index("assistant\n") + len("assistant\n")
    assert any(s < start < e for s, e in whole["offset_mapping"])  # header's and reply's \n: one token
    ids, mask, _ = tokenize_conversation(tok, messages, 512)
    assert masked_text(tok, ids, mask) == "\n\nHello<|im_end|>"
    assert tok.decode(ids) == text and len(ids) == len(whole["input_ids"]) + 1
