"""Fewer kernels for the draft's decoding steps: its RMSNorms fused, its rotary embedding looked up.

At batch 1 a draft round's time is its kernel count (docs/BENCHMARKS.md). Hugging Face's Llama-style RMSNorm runs as
about eight kernels (upcast, square, mean, add, rsqrt, multiply, downcast, weight), and a round of SmolLM2's one-layer
EAGLE-3 draft runs twelve of them: about a third of its kernels. PyTorch's `rms_norm` is one fused kernel on CUDA
(the same arithmetic in float, rounded once instead of twice; its composite elsewhere). The rotary embedding computes
cos and sin from the position ids in each forward (about ten kernels); a table of every position's, computed once by
the same module, is two lookups with the same values. The offline benchmark fuses its target's RMSNorms too, for the
baseline and every method alike (draftsmith.benchmark.offline). Here too: the draft's decoder layers as every decoder
runs them (`draft_layers`, with SDPA and a KV cache: `use_sdpa`).
"""

from __future__ import annotations

import functools

import torch


def _fused_norm_forward(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    if hidden.dtype != norm.weight.dtype:  # the module's own promotion rules
        return type(norm).forward(norm, hidden)
    return torch.nn.functional.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)


def is_llama_rms_norm(module: torch.nn.Module) -> bool:
    """An RMSNorm computing weight * x / rms(x) with `variance_epsilon` (Llama, Qwen, Mistral; not Gemma's
    (1 + weight), whose epsilon is `eps`)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "variance_epsilon", None), float)
            and isinstance(weight, torch.Tensor) and weight.dim() == 1)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Run every Llama-style RMSNorm of `model` through `torch.nn.functional.rms_norm` from now on; returns how
    many (idempotent)."""
    norms = [m for m in model.modules() if is_llama_rms_norm(m)]
    for norm in norms:
        norm.forward = functools.partial(_fused_norm_forward, norm)
    return len(norms)


class RotaryTable(torch.nn.Module):
    """cos and sin of positions 0..length-1 from `rotary` (a Hugging Face rotary embedding), computed on a first call
    per dtype and device; later calls index them. (Decoding steps captured as CUDA graphs warm up before capturing,
    so the tables exist before a capture.)"""

    def __init__(self, rotary: torch.nn.Module, length: int):
        super().__init__()
        self.rotary, self.length = rotary, length
        self.tables: dict = {}

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (x.dtype, x.device)
        if key not in self.tables:
            positions = torch.arange(self.length, device=x.device)[None]
            cos, sin = self.rotary(x, positions)
            self.tables[key] = (cos[0], sin[0])
        cos, sin = self.tables[key]
        # a prompt padded to its capture bucket may run past the table: padding, whose outputs are never read
        # (and a real position past max_position_embeddings, which the model was not trained for, gets the last row)
        position_ids = position_ids.clamp(max=self.length - 1)
        return cos[position_ids], sin[position_ids]


def tabulate_rotary(draft: torch.nn.Module) -> bool:
    """Replace `draft.rotary_emb` by a RotaryTable over the draft's max_position_embeddings + 1 positions (EAGLE-3's
    position ids run one ahead; the tables hold 2 x head_dim values a position: 2 MB for SmolLM2's 8,192 in bf16),
    unless its rope type rescales with the sequence length (dynamic, longrope) or it is tabulated already. Returns
    whether it is tabulated now."""
    rotary = getattr(draft, "rotary_emb", None)
    if isinstance(rotary, RotaryTable):
        return True
    if not isinstance(rotary, torch.nn.Module) or getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return False
    config = getattr(draft.config, "transformer_layer_config", draft.config)
    draft.rotary_emb = RotaryTable(rotary, config.max_position_embeddings + 1)
    return True


def use_sdpa(draft) -> None:
    """Decode with SDPA and a KV cache; the checkpoint's layer config asks for speculators' FlexAttention (training)."""
    draft.config.transformer_layer_config._attn_implementation = "sdpa"
    for layer in draft.layers:
        layer.self_attn.config._attn_implementation = "sdpa"


def draft_layers(draft, token_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                 cache_position: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor:
    """The draft's decoder layers on `cat(embed(token_ids), hidden)` ([B, n], [B, n, H]) at `position_ids` ([B, n]),
    the caller's `mask` and cache (`cache_position`: where a static cache writes). Returns the last layer's output
    before `norm` ([B, n, H])."""
    states = torch.cat([draft.embed_tokens(token_ids), hidden], dim=-1)
    position_embeddings = draft.rotary_emb(states, position_ids)
    for layer in draft.layers:
        states = layer(states, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                       use_cache=cache is not None, cache_position=cache_position,
                       position_embeddings=position_embeddings)
    return states
