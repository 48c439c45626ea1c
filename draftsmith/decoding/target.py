"""The target as the decoders run it: a Hugging Face causal LM with hooks on its auxiliary decoder layers (`call`
returns their inputs beside the logits), which the engine (draftsmith.decoding.engine) drives over its static cache and
the reference loops (draftsmith.decoding.reference) over transformers' DynamicCache.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from draftsmith.decoding.static_cache import full_attention_sdpa
from draftsmith.target_model.layers import find_decoder


class TargetModel:
    """A Hugging Face causal LM with hooks on its auxiliary decoder layers (`call` returns their inputs beside the
    logits), decoding one sequence eagerly over transformers' DynamicCache (`start`, `forward`, `rewind`: the
    reference loops). `static`: whether its masks are draftsmith's to build (full-attention SDPA), so that the engine
    (BatchTarget) can keep its cache static."""

    def __init__(self, model, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.aux_layer_ids = list(aux_layer_ids or [])
        self._capturing = False
        self._captured: dict[int, torch.Tensor] = {}
        decoder = find_decoder(model) if self.aux_layer_ids else None  # a target without hooks may have any layout
        for layer_id in self.aux_layer_ids:
            decoder.layers[layer_id].register_forward_pre_hook(self._hook(layer_id), with_kwargs=True)
        # whether the forward takes `logits_to_keep` (then a step computes only the logits it reads)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.static = full_attention_sdpa(model)
        self.cache: DynamicCache | None = None

    def _hook(self, layer_id: int):
        def hook(_module, args, kwargs):
            if self._capturing:
                self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    def start(self, prompt_ids: list[int], with_aux: bool = False, keep: int = 1):
        """A new sequence: run the prompt. Returns the last `keep` positions' logits and, with `with_aux`, the
        prompt's auxiliary states."""
        self.cache = DynamicCache()
        return self.forward(torch.tensor([prompt_ids], device=self.device), keep=keep, with_aux=with_aux)

    def rewind(self, length: int) -> None:
        """Forget every position from `length` on."""
        self.cache.crop(length)

    def forward(self, input_ids: torch.Tensor, keep: int, with_aux: bool = False):
        """Run `input_ids` [1, q] after the cached positions. Returns the logits of the last `keep` positions [keep, V]
        and, with `with_aux`, the auxiliary states [1, q, 3H]."""
        if with_aux and not self.aux_layer_ids:
            raise ValueError("this TargetModel was built without auxiliary layer ids")
        logits, aux = self.call(keep, with_aux, input_ids=input_ids, past_key_values=self.cache)
        return logits[0], aux

    def call(self, keep: int | torch.Tensor, with_aux: bool, **model_kwargs):
        """The model's forward (`model_kwargs`: inputs, mask, cache) keeping the last `keep` positions' logits
        ([B, keep, V]; a tensor of positions: those) and, with `with_aux`, the auxiliary layers' inputs ([B, q, 3H];
        else None). The engine (draftsmith.decoding.engine) calls it too, for the same hooks."""
        self._captured.clear()
        self._capturing = with_aux
        extra = {"logits_to_keep": keep} if self._keeps_logits else {}
        try:
            out = self.model(**model_kwargs, use_cache=True, **extra)
        finally:
            self._capturing = False
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1) if with_aux else None
        if self._keeps_logits:
            return out.logits, aux
        return (out.logits[:, keep] if isinstance(keep, torch.Tensor) else out.logits[:, -keep:]), aux
