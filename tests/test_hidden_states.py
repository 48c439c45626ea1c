import torch
from transformers import AutoModelForCausalLM

from draftsmith.data.tokenization import read_samples
from draftsmith.extraction.hf_backend import HFHiddenStateExtractor, plan_batches
from draftsmith.target_model.layers import default_aux_layer_ids, find_decoder, resolve_aux_layer_ids

AUX = [1, 3, 4]


def test_default_layers_follow_vllm_and_bad_ids_are_rejected():
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert resolve_aux_layer_ids(None, 24) == [2, 12, 21]
    import pytest

    with pytest.raises(ValueError, match=r"outside the target's decoder layers 0..5"):
        resolve_aux_layer_ids([1, 2, 6], 6)
    with pytest.raises(ValueError, match="exactly 3"):
        resolve_aux_layer_ids([1, 2], 6)
    with pytest.raises(ValueError, match=r"\[2, 2, 5\] \(extraction.aux_layer_ids\) repeat a layer"):
        resolve_aux_layer_ids([2, 2, 5], 6)  # extraction and the benchmark resolve through here too


def test_plan_batches_respects_the_token_budget_and_covers_every_sample_once():
    lengths = [5, 90, 33, 33, 120, 7, 64, 64, 1]
    batches = plan_batches(lengths, batch_tokens=130, max_batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3 and max(lengths[i] for i in b) * len(b) <= 130 or len(b) == 1
    assert plan_batches(lengths, 130, 3) == batches  # deterministic (resume relies on it)


def test_states_match_a_plain_forward_at_the_vllm_layers(tiny_target, tiny_samples):
    """Aux layer i is HF hidden_states[i] (the input of decoder layer i); the last is what lm_head reads."""
    samples = read_samples(tiny_samples)["input_ids"][:6]
    extractor = HFHiddenStateExtractor(str(tiny_target), AUX, device="cpu", dtype="float32")
    batched = extractor.forward(samples)  # one padded batch of different lengths
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for row, ids in enumerate(samples):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        n = len(ids)
        for k, layer in enumerate(AUX):
            torch.testing.assert_close(batched[k, row, :n], out.hidden_states[layer][0], rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            logits_from_final = model.lm_head(batched[3, row, :n].clone())
        torch.testing.assert_close(logits_from_final, out.logits[0], rtol=1e-4, atol=1e-4)
        single = extractor.sample_states(ids)
        for k in range(4):
            torch.testing.assert_close(single[k], batched[k, row, :n], rtol=1e-4, atol=1e-5)


def test_decoder_is_found_in_plain_and_multimodal_wrappers(tiny_target):
    import pytest

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert find_decoder(model) is model.model

    class LanguageModel(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

    class Wrapper(torch.nn.Module):  # the Kimi-K2.5 layout: model.language_model.model
        def __init__(self, inner):
            super().__init__()
            self.language_model = LanguageModel(inner)

    assert find_decoder(Wrapper(model.model)) is model.model
    with pytest.raises(TypeError, match="Linear"):
        find_decoder(torch.nn.Linear(2, 2))
