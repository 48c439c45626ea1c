"""Loading the target's tokenizer and config, with trust_remote_code only where opted in."""

from __future__ import annotations

from draftsmith.layers import text_config


def load_tokenizer(model: str, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)
    if tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer of {model} has no chat template; draftsmith needs one to render conversations")
    return tokenizer


def load_text_config(model: str, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoConfig

    return text_config(AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision))
