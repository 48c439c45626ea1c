"""A decode step's attention over each row's own cache slots (a Triton kernel), for the engine's target-only decode
steps.

With SDPA every row of a decode step reads the same span of the cache: the slots the longest busy sequence needs.
Measured on one H100 (docs/BENCHMARKS.md, "Regenerate throughput"): at batch 2048 over 2,339 real prompts, busy rows filled
210 slots on average while the steps read 700 (and a quarter of the rows were free), so ~80% of the attention's reads
were padding, and the attention was about half of a step (~5 ms per 256 slots). Here each (row, KV head) reads only
its slots start..end, in blocks of BLOCK_N, with the query heads that share the KV head as the rows of one tile
(grouped-query attention without copies) and an online softmax in float32.

FlexAttention with a per-row block mask did the same and was slower than SDPA over the span (36.7 vs 28.9 ms a
step at batch 2048 on the H100), which is why this is a kernel of its own.

Triton compiles it for a GPU; on a CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1), which the tests use
to check it against SDPA.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

BLOCK_N = 64  # cache slots per tile
NUM_WARPS = 4


def ragged_attention_available(device: torch.device) -> str | None:
    """None when the kernel can run on `device`, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Triton kernels need a CUDA device (here {device.type}; TRITON_INTERPRET=1 runs them on a CPU, slowly)"
    return None


@lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ragged_decode_kernel(Q, K, V, Out, Bounds, scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_kl,
                             stride_vb, stride_vh, stride_vl, stride_ob, stride_oh,
                             GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, D: tl.constexpr, D_TILE: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        start = tl.load(Bounds + 2 * row)
        end = tl.load(Bounds + 2 * row + 1)  # inclusive: the slot this step wrote
        heads = tl.arange(0, GROUP_TILE)
        dims = tl.arange(0, D_TILE)
        head_mask = (heads < GROUP)[:, None]
        if D_TILE != D:  # a head size that is no power of two, padded with zeros (resolved at compile time)
            head_mask = head_mask & (dims < D)[None, :]
        q_ptr = Q + row * stride_qb + (kv_head * GROUP + heads)[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr, mask=head_mask, other=0.0)
        m = tl.full([GROUP_TILE], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_TILE], tl.float32)
        acc = tl.zeros([GROUP_TILE, D_TILE], tl.float32)
        k_base = K + row * stride_kb + kv_head * stride_kh
        v_base = V + row * stride_vb + kv_head * stride_vh
        for first in range((start // BLOCK) * BLOCK, end + 1, BLOCK):
            slots = first + tl.arange(0, BLOCK)
            inside = (slots >= start) & (slots <= end)
            slot_mask = inside[:, None]
            if D_TILE != D:
                slot_mask = slot_mask & (dims < D)[None, :]
            k = tl.load(k_base + slots[:, None] * stride_kl + dims[None, :], mask=slot_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(inside[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slots[:, None] * stride_vl + dims[None, :], mask=slot_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / total[:, None]
        o_ptr = Out + row * stride_ob + (kv_head * GROUP + heads)[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=head_mask)

    return ragged_decode_kernel


def tile(size: int) -> int:
    """A tile's side for `size`: the next power of two, 16 at least (Triton's block shapes and tl.dot's minimum)."""
    return max(16, 1 << (size - 1).bit_length())


def ragged_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
                            scale: float, block: int = BLOCK_N, warps: int = NUM_WARPS) -> torch.Tensor:
    """query [B, H, 1, D] (one token per row); key, value [B, KV, L, D] (the cache, H a multiple of KV: query head
    h uses KV head h // (H // KV)); bounds [B, 2] (contiguous int64: each row attends its slots bounds[b, 0]..
    bounds[b, 1], inclusive, a non-empty range). Returns [B, 1, H, D], as transformers' attention functions do.
    `block` (slots per tile) and `warps` are the launch's tuning (docs/BENCHMARKS.md, "Regenerate throughput")."""
    rows, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    if width != 1 or heads % kv_heads:
        raise ValueError(f"ragged decode attention takes one query token per row and query heads a multiple of the "
                         f"KV heads; got query {tuple(query.shape)}, key {tuple(key.shape)}")
    if bounds.shape != (rows, 2) or not bounds.is_contiguous():
        raise ValueError(f"bounds must be a contiguous [{rows}, 2] tensor, got {tuple(bounds.shape)}")
    if key.stride(3) != 1 or value.stride(3) != 1 or query.stride(3) != 1:
        raise ValueError("query, key and value need contiguous head dimensions")
    group = heads // kv_heads
    out = torch.empty((rows, 1, heads, dim), dtype=query.dtype, device=query.device)
    _kernel()[(rows, kv_heads)](
        query, key, value, out, bounds, scale, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        key.stride(2), value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(2),
        GROUP=group, GROUP_TILE=tile(group), D=dim, D_TILE=tile(dim), BLOCK=block, num_warps=warps)
    return out
