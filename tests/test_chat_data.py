import json

import pytest

from draftsmith.data.chat_data import BadRecord, normalise
from draftsmith.data.readers import iter_records


def test_sharegpt_and_openai_records_normalise_to_the_same_messages():
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello!"}]}
    openai = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello!"}]}
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}]
    assert normalise(sharegpt) == expected
    assert normalise(openai) == expected


@pytest.mark.parametrize(
    "record, reason, field",
    [
        ({"text": "no chat"}, "no_conversation", "messages"),
        ({"messages": []}, "empty_conversation", "messages"),
        ({"messages": "Hi there"}, "conversation_not_a_list", "messages"),
        ({"conversations": {"from": "human"}}, "conversation_not_a_list", "conversations"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "no_assistant_turn", "messages"),
        ({"messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}]}, "starts_with_assistant", "messages"),
        ({"messages": [{"role": "wizard", "content": "Hi"}]}, "unknown_role", "messages[0].role"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]}, "empty_content", "messages[1].content"),
        ({"conversations": [{"from": "human", "value": 3}]}, "non_string_content", "conversations[0].value"),
        ({"messages": ["just a string"]}, "malformed_turn", "messages[0]"),
        ({"messages": [{"role": "user", "content": "a\ud800b"}, {"role": "assistant", "content": "x"}]},
         "invalid_unicode", "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                    {"type": "image_url", "image_url": {"url": "x.png"}}]},
                       {"role": "assistant", "content": "A cat."}]}, "non_text_content", "messages[0].content[1]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]},
                       {"role": "assistant", "content": "x"}]},
         "malformed_content_part", "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
         "malformed_tool_call", "messages[1].tool_calls[0].arguments"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
         "non_string_content", "messages[1].content"),
    ],
)
def test_bad_records_name_reason_and_field(record, reason, field):
    with pytest.raises(BadRecord) as e:
        normalise(record)
    assert e.value.reason == reason
    assert field in str(e.value)


def test_tool_developer_and_content_part_records_are_kept():
    record = {"messages": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
        {"role": "function", "name": "weather", "content": ""},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is -3 C."}]},
    ]}
    assert normalise(record) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "c1"},
        {"role": "tool", "content": "", "name": "weather"},
        {"role": "assistant", "content": "It is -3 C."},
    ]


def read(path, **spec):
    return list(iter_records({"source": "local", "path": str(path), **spec}))


GOOD = {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}


def test_jsonl_reader_names_lines_and_what_is_wrong_with_them(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n{not json\n\n[1, 2]\n"
                     + b'{"id": "b", "messages": "caf\xe9"}\n' + b'"just a string"\r\n'
                     + json.dumps({**GOOD, "id": "c"}, ensure_ascii=False).encode() + b"\n")
    records = read(path)
    assert [(r.line, r.index, r.record_id, r.reason) for r in records] == [
        (1, 0, "a", ""), (2, 1, "line 2", "invalid_json"), (4, 3, "line 4", "not_an_object"),
        (5, 4, "line 5", "invalid_utf8"), (6, 5, "line 6", "not_an_object"), (7, 6, "c", "")]
    assert records[0].data == GOOD  # the BOM on the first line is accepted
    assert "invalid JSON" in records[1].error and "JSON array, not a JSON object" in records[2].error
    assert "byte 0xe9" in records[3].error and "JSON string, not a JSON object" in records[4].error
    assert records[0].where == f"{path}: line 1 (id a)" and records[1].where == f"{path}: line 2"


def test_json_file_is_an_array_or_json_lines_read_without_type_inference(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("local files must not use datasets"))
    # Records whose fields differ in type from record to record: a columnar loader would have to
    # unify them (or fail); read record by record, each stays exactly as written.
    rows = [{"id": "007", "messages": GOOD["messages"], "meta": 1},
            {"id": 8, "messages": GOOD["messages"], "meta": {"k": [1, "x"]}},
            ["not", "an", "object"],
            {"messages": [{"role": "user", "content": "1e5"}, {"role": "assistant", "content": "null"}], "meta": None}]
    array = tmp_path / "array.json"
    array.write_text("\ufeff  \n" + json.dumps(rows, indent=2))
    records = read(array)
    assert [(r.line, r.index, r.record_id, r.reason) for r in records] == [
        (None, 0, "007", ""), (None, 1, "8", ""), (None, 2, "record 2", "not_an_object"), (None, 3, "record 3", "")]
    assert [r.data for r in records] == [rows[0], rows[1], None, rows[3]]
    assert records[3].where == f"{array}: record 3"
    lines = tmp_path / "lines.json"
    lines.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [(r.line, r.record_id, r.data) for r in read(lines)] == [
        (1, "007", rows[0]), (2, "8", rows[1]), (3, "line 3", None), (4, "line 4", rows[3])]


def test_a_broken_json_array_fails_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"messages": []},\n  {"messages": oops}\n]')
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON \(line 3, column 16"):
        read(bad)
    bad.write_bytes(b'[\n{"messages": "\xff"}]')
    with pytest.raises(ValueError, match=r"bad.json: invalid UTF-8 at byte 17 \(line 2\)"):
        read(bad)


def test_parquet_rows_are_read_with_pyarrow_and_normalised(tmp_path, monkeypatch):
    import datasets
    import pandas as pd

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("local files must not use datasets"))
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    records = read(tmp_path / "d.parquet", max_records=2)
    assert [(r.record_id, r.index, r.line) for r in records] == [("r0", 0, None), ("r1", 1, None)]
    assert normalise(records[1].data)[1] == {"role": "assistant", "content": "a1"}
    assert records[1].where == f"{tmp_path / 'd.parquet'}: record 1 (id r1)"
    parts = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]}]}]
    pd.DataFrame(parts).to_parquet(tmp_path / "parts.parquet")
    assert normalise(read(tmp_path / "parts.parquet")[0].data)[1] == {"role": "assistant", "content": "Yo"}


@pytest.mark.parametrize("frame, error", [
    ({"text": ["hello"]}, r"no 'messages' or 'conversations' column \(columns: text\)"),
    ({"messages": ['[{"role": "user", "content": "hi"}]']},
     r"column 'messages' has type (large_)?string; expected a list of structs"),
    ({"conversations": [["hi", "yo"]]}, r"column 'conversations' has type (large_)?list<element: (large_)?string>"),
])
def test_parquet_schema_is_checked_naming_file_and_column(tmp_path, frame, error):
    import pandas as pd

    pd.DataFrame(frame).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet: " + error):
        read(tmp_path / "d.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk.parquet: not a readable Parquet file"):
        read(tmp_path / "junk.parquet")


def test_missing_file_and_unknown_type_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list(iter_records({"source": "local", "path": str(tmp_path / "nope.jsonl")}))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported dataset file type"):
        list(iter_records({"source": "local", "path": str(tmp_path / "x.csv")}))
