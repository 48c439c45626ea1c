import json

import pytest
from transformers import AutoTokenizer

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


def test_prepare_dataset_counts_kept_and_skipped_records(tokenizer, tmp_path):
    records = [
        {"id": "ok", "messages": CONV},
        {"id": "no-assistant", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "bad-role", "conversations": [{"from": "alien", "value": "hi"}]},
        {"id": "long", "messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "y"}]},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n{broken\n")
    stats = prepare_dataset({"source": "local", "path": str(path)}, tokenizer, 64, tmp_path / "s.parquet",
                            tmp_path / "stats.json", name="mix")
    assert stats["records_read"] == 5 and stats["records_kept"] == 1
    assert stats["skipped_by_reason"] == {"invalid_json": 1, "no_assistant_tokens_in_window": 1,
                                          "no_assistant_turn": 1, "unknown_role": 1}
    samples = read_samples(tmp_path / "s.parquet")
    assert samples["sample_id"] == ["mix/ok"]
    assert stats["tokens"] == len(samples["input_ids"][0]) and stats["assistant_tokens"] == sum(samples["loss_mask"][0])
    assert json.loads((tmp_path / "stats.json").read_text()) == stats


def test_dataset_without_usable_records_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"no usable records \(1 read; skipped by reason: \{'no_assistant_turn': 1\}\)"):
        prepare_dataset({"source": "local", "path": str(path)}, tokenizer, 64, tmp_path / "s.parquet",
                        tmp_path / "stats.json", name="empty")
    assert not (tmp_path / "s.parquet").exists() and not (tmp_path / "stats.json").exists()
