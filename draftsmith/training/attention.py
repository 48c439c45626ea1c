"""How the draft's attention trains: a FlexAttention stand-in where FlexAttention cannot run, and FlexAttention
compiled alone where it can (`training.compile: attention`).

speculators 0.3.0 trains the EAGLE-3 draft with `simple_flex_attention` and a BlockMask.
On CPU, FlexAttention has no backward ("FlexAttention does not support backward on CPU")
and its forward is slow. This module evaluates the BlockMask's own `mask_mod` over the full
query x key grid into a dense boolean mask and runs scaled-dot-product attention with it,
so the mask semantics are the same by construction (a test checks the outputs match).

On a GPU, speculators 0.3.0 compiles the draft's whole forward (`@torch.compile` on `Eagle3DraftModel.forward`): its
graph breaks (the DynamicCache, the BlockMask built per batch, `masked_select` in the accuracy), the TTT steps'
growing key length, train against validation (grad mode) and the packed batches' varying document count each give
graphs of their own, and the first optimizer step waited minutes for them (35 graphs, 344 s on an H100 for
SmolLM2-135M's draft). `compile_attention_only` runs that forward eagerly and compiles only speculators' own
FlexAttention call (eager FlexAttention materialises the scores), one graph per TTT step's key length.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

DENSE_MASK_SDPA = "draftsmith_dense_mask_sdpa"
COMPILED_FLEX_ATTENTION = "draftsmith_compiled_flex_attention"


def dense_mask(block_mask) -> torch.Tensor:
    """Boolean [q_len, kv_len] mask (True = attend) from a BlockMask's mask_mod."""
    q_len, kv_len = block_mask.seq_lengths
    device = block_mask.kv_num_blocks.device
    q = torch.arange(q_len, device=device)[:, None]
    kv = torch.arange(kv_len, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    return block_mask.mask_mod(zero, zero, q, kv).expand(q_len, kv_len)


def dense_mask_sdpa_forward(module, query, key, value, attention_mask, scaling=None, **_kwargs):
    """Same signature and output layout as speculators' `flex_attention_forward`."""
    mask = dense_mask(attention_mask)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(DENSE_MASK_SDPA, dense_mask_sdpa_forward)
    return DENSE_MASK_SDPA


def compile_attention_only(model) -> None:
    """The draft's forward without speculators' `@torch.compile`, its attention through speculators'
    `flex_attention_forward` compiled on its own (static shapes: the packed batch has a fixed length)."""
    from speculators.models.eagle3.attention import flex_attention_forward
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(COMPILED_FLEX_ATTENTION, torch.compile(flex_attention_forward, dynamic=False))
    model.forward = types.MethodType(eager_forward(type(model).forward), model)
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = COMPILED_FLEX_ATTENTION


def eager_forward(function):
    """The function `torch.compile` wrapped (its own attribute for it, probed; `__wrapped__` as functools sets it)."""
    for attribute in ("_torchdynamo_orig_callable", "__wrapped__"):
        inner = getattr(function, attribute, None)
        if callable(inner):
            return inner
    raise RuntimeError(f"{function.__qualname__} is not a torch.compile wrapper: training.compile: attention cannot "
                       "run it eagerly with this torch; set training.compile: forward")


def flex_attention_trains_on(device: torch.device) -> bool:
    """Whether FlexAttention's backward runs on `device` (probed, not assumed from the version)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if device.type == "cuda":
        return True
    q = torch.randn(1, 1, 128, 16, device=device, requires_grad=True)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 128, 128, device=device)
    try:
        flex_attention(q, q, q, block_mask=mask).sum().backward()
    except Exception:  # noqa: BLE001 - any failure means: do not train with it here
        return False
    return True
