"""A FlexAttention stand-in for training the draft where FlexAttention cannot run.

speculators 0.3.0 trains the EAGLE-3 draft with `simple_flex_attention` and a BlockMask.
On CPU, FlexAttention has no backward ("FlexAttention does not support backward on CPU")
and its forward is slow. This module evaluates the BlockMask's own `mask_mod` over the full
query x key grid into a dense boolean mask and runs scaled-dot-product attention with it,
so the mask semantics are the same by construction (a test checks the outputs match).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DENSE_MASK_SDPA = "draftsmith_dense_mask_sdpa"


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
