"""Property: for any conversation, the loss-masked tokens decode to exactly the assistant replies, each
followed by the template's end-of-turn token, and nothing else (no header, no user/system/tool text,
no newline after the end token).

Run on the embedded target's own tokenizer and template (the `tiny_target` fixture) and on the same
tokenizer carrying the real Llama-3, SmolLM2 (ChatML) and Qwen2.5 templates; contents include strings
that a search-based mask confuses (role names, end markers, whitespace, unicode). A second tokenizer,
trained by the project's code on text with whitespace runs, merges a reply's leading newlines with the
header's, which exercises the split at the reply boundary.
"""

from __future__ import annotations

import pytest
from chat_templates import CHATML_TOKENS, LLAMA3_TEMPLATE, LLAMA3_TOKENS, QWEN25_TEMPLATE, SMOLLM2_TEMPLATE, with_template
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from draftsmith.data.chat_data import normalise
from draftsmith.data.synthetic import generate_corpus
from draftsmith.data.tokenization import tokenize_conversation
from draftsmith.target_model.embedded import train_tokenizer

PROPERTY = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ADVERSARIAL = ["assistant", "a", "end", "user", "system", "tool", "<|im_end|>", "<|im_start|>assistant\n",
               "<|end|>", "<|assistant|>", "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n",
               "\n", "\n\n", " ", "  ", "\t", "\r\n", "\u3000", "é", "e\u0301", "😀", "中文", "{{ x }}", "{% raw %}",
               "'", '"', "\\", "0", "2 + 2 = 4."]
piece = st.one_of(st.sampled_from(ADVERSARIAL), st.text(max_size=6))
content = st.lists(piece, min_size=1, max_size=6).map("".join).filter(lambda s: s.strip())


@st.composite
def conversations(draw, tool_turns: bool = True):
    messages = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(content)})
    for _ in range(draw(st.integers(1, 3))):
        messages += [{"role": "user", "content": draw(content)}, {"role": "assistant", "content": draw(content)}]
        if tool_turns and draw(st.booleans()):
            messages += [{"role": "tool", "content": draw(content)}, {"role": "assistant", "content": draw(content)}]
    return messages


def masked_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m], clean_up_tokenization_spaces=False)


def expected_text(messages, end: str, trim: bool) -> str:
    return "".join((m["content"].strip() if trim else m["content"]) + end for m in messages if m["role"] == "assistant")


def check(tokenizer, raw_messages, end: str, trim: bool = False):
    messages = normalise({"messages": raw_messages})
    ids, mask, truncated = tokenize_conversation(tokenizer, messages, 1 << 20)
    assert not truncated and len(ids) == len(mask)
    assert masked_text(tokenizer, ids, mask) == expected_text(messages, end, trim)
    # the masked tokens are the ones the template put there: the unmasked rest is the prompt side
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text


@pytest.fixture(scope="module")
def embedded(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.fixture(scope="module")
def whitespace_tokenizer(tmp_path_factory):
    """The embedded tokenizer's recipe, trained on text with whitespace runs so that '\\n\\n', '\\n ' and
    '  ' are single tokens (as in real BPE vocabularies)."""
    train, _ = generate_corpus(60, 1, seed=0)
    texts = [m["content"] for r in train for m in r["messages"]]
    texts += ["a\n\nb\n \nc  d\n\n\ne\t\tf \n  g\r\n\r\nh"] * 50
    out = tmp_path_factory.mktemp("ws_tok")
    train_tokenizer(texts, 450, out)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok("\n\n", add_special_tokens=False)["input_ids"]) == 1
    return tok


# case -> (tokenizer: the embedded target's or the whitespace-merging one; (chat template, its special tokens),
# or None for the tokenizer's own, the embedded template; the template's end-of-turn token; whether it strips replies)
CASES = {
    "embedded": ("embedded", None, "<|end|>", False),
    "llama3-trims-content": ("embedded", (LLAMA3_TEMPLATE, LLAMA3_TOKENS), "<|eot_id|>", True),
    "smollm2-chatml-embedded": ("embedded", (SMOLLM2_TEMPLATE, CHATML_TOKENS), "<|im_end|>", False),
    "smollm2-chatml-whitespace": ("whitespace", (SMOLLM2_TEMPLATE, CHATML_TOKENS), "<|im_end|>", False),
    "qwen25-whitespace": ("whitespace", (QWEN25_TEMPLATE, CHATML_TOKENS), "<|im_end|>", False),
    "whitespace-merging-on-the-embedded-template": ("whitespace", None, "<|end|>", False),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, embedded, whitespace_tokenizer):
    """(tokenizer carrying the case's template, end-of-turn token, trim)."""
    base, template, end, trim = CASES[request.param]
    tokenizer = embedded if base == "embedded" else whitespace_tokenizer
    return (with_template(tokenizer, *template) if template else tokenizer), end, trim


@PROPERTY
@given(messages=conversations())
def test_masked_tokens_are_the_assistant_replies(case, messages):
    tokenizer, end, trim = case
    check(tokenizer, messages, end, trim)
