import json

import pytest

from draftsmith.data.chat_data import BadRecord, iter_records, normalise


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
        ({"messages": [{"role": "user", "content": "Hi"}]}, "no_assistant_turn", "messages"),
        ({"messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}]}, "starts_with_assistant", "messages"),
        ({"messages": [{"role": "wizard", "content": "Hi"}]}, "unknown_role", "messages[0].role"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]}, "empty_content", "messages[1].content"),
        ({"conversations": [{"from": "human", "value": 3}]}, "non_string_content", "conversations[0].value"),
        ({"messages": ["just a string"]}, "malformed_turn", "messages[0]"),
    ],
)
def test_bad_records_name_reason_and_field(record, reason, field):
    with pytest.raises(BadRecord) as e:
        normalise(record)
    assert e.value.reason == reason
    assert field in str(e.value)


def test_jsonl_reader_reports_invalid_lines_with_line_numbers(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    path.write_text(json.dumps(good) + "\n{not json\n\n[1, 2]\n")
    records = list(iter_records({"source": "local", "path": str(path)}))
    assert [r.record_id for r in records] == ["a", "line 2", "line 4"]
    assert records[0].data == good
    assert records[1].data is None and "invalid JSON" in records[1].error
    assert records[2].data is None and "not a JSON object" in records[2].error


def test_parquet_and_json_files_load_through_datasets(tmp_path):
    import pandas as pd

    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    for name in ("d.parquet", "d.json"):
        records = list(iter_records({"source": "local", "path": str(tmp_path / name), "max_records": 2}))
        assert [r.record_id for r in records] == ["r0", "r1"]
        assert normalise(records[1].data)[1] == {"role": "assistant", "content": "a1"}


def test_missing_file_and_unknown_type_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list(iter_records({"source": "local", "path": str(tmp_path / "nope.jsonl")}))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported dataset file type"):
        list(iter_records({"source": "local", "path": str(tmp_path / "x.csv")}))
