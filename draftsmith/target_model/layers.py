"""EAGLE-3 layer selection and locating the decoder inside a target model.

Convention (vLLM's, and the original EAGLE code's): auxiliary layer id i means the hidden
state *entering* decoder layer i, which is Hugging Face's `hidden_states[i]`. The fourth
tensor is the last layer after the final norm, the state the target's lm_head reads.
"""

from __future__ import annotations

LAYER_CONVENTION = "aux layer i = input of decoder layer i (HF hidden_states[i]); last = output of the final norm"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 auxiliary layers for a target of `num_layers` decoder layers."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    ids = list(configured) if configured else default_aux_layer_ids(num_layers)
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 needs exactly 3 auxiliary layer ids, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"auxiliary layer ids {bad} are outside the target's decoder layers 0..{num_layers - 1}")
    if len(set(ids)) != len(ids):
        where = "extraction.aux_layer_ids" if configured else f"vLLM's default [2, L//2, L-3] for L={num_layers}"
        raise ValueError(f"auxiliary layer ids {ids} ({where}) repeat a layer; set extraction.aux_layer_ids "
                         f"to three different layers of 0..{num_layers - 1}")
    return ids


def text_config(config):
    """The language-model config of a (possibly multimodal) HF config."""
    return getattr(config, "text_config", None) or config


def find_decoder(model):
    """The decoder stack (with `.layers` and `.norm`) of a causal LM or a multimodal wrapper.

    Plain causal LMs keep it at `model.model`; multimodal wrappers such as Kimi-K2.5 keep it at
    `model.language_model.model` (or `model.model.language_model`).
    """
    candidates = [
        ("model.language_model.model", lambda m: m.language_model.model),
        ("model.model.language_model", lambda m: m.model.language_model),
        ("model.model", lambda m: m.model),
    ]
    for _, get in candidates:
        try:
            decoder = get(model)
        except AttributeError:
            continue
        if hasattr(decoder, "layers") and hasattr(decoder, "norm"):
            return decoder
    raise TypeError(
        f"cannot find the decoder layers in {type(model).__name__}: looked for "
        + ", ".join(name for name, _ in candidates)
        + " with `.layers` and `.norm`"
    )
