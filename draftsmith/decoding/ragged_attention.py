"""The attention of the engine's target steps over each row's own cache slots (a Triton kernel): a decode step's one
token a row, or a verification's few, each query attending from its row's first slot up to its own.

SDPA reads every slot it is given, through a mask: every row of a step reads the same slots of the cache (the `sdpa`
path hands it the whole cache). Measured on one H100 (docs/BENCHMARKS.md, "Regenerate throughput") when SDPA read the
slots the longest busy sequence needed: at batch 2048 over 2,339 real prompts, busy rows filled 210 slots on average
while the steps read 700 (and a quarter of the rows were free), so ~80% of the attention's reads were padding, and
the attention was about half of a step (~5 ms per 256 slots). Here each (row, KV head) reads only its slots
start..end, in blocks of BLOCK_N, with the query heads that share the KV head (and a verification's tokens) as the
rows of one tile (grouped-query attention without copies, and no mask to build or read) and an online softmax in
float32.

FlexAttention with a per-row block mask did the same and was slower than that SDPA (36.7 vs 28.9 ms a step at batch
2048 on the H100), which is why this is a kernel of its own.

Triton compiles it for a GPU; on a CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1), which the tests use
to check it against SDPA.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import torch

log = logging.getLogger(__name__)

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


def require_ragged(device: torch.device) -> None:
    """A clear error, at construction, for a decoder asked to attend through the kernel where it cannot run."""
    problem = ragged_attention_available(device)
    if problem:
        raise ValueError(f"ragged attention: {problem}")


def use_ragged(setting: str, device: torch.device, section: str) -> bool:
    """`<section>.attention`: whether the steps attend to each row's own slots (ragged, on a CUDA device where Triton
    runs; without Triton a warning) or SDPA over the whole cache through the rows' masks (sdpa, and always on a CPU)."""
    if setting not in ("ragged", "sdpa"):
        raise ValueError(f"{section}.attention must be ragged or sdpa, got {setting!r}")
    if device.type != "cuda" or setting == "sdpa":
        return False
    problem = ragged_attention_available(device)
    if problem:
        log.warning("%s: SDPA over the whole cache, not each row's own slots (%s)", section, problem)
    return problem is None


@lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ragged_kernel(Q, K, V, Out, Bounds, scale, stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kl,
                      stride_vb, stride_vh, stride_vl, stride_ob, stride_oq, stride_oh,
                      GROUP: tl.constexpr, QUERIES: tl.constexpr, ROWS_TILE: tl.constexpr, D: tl.constexpr,
                      D_TILE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        start = tl.load(Bounds + 2 * row)
        end = tl.load(Bounds + 2 * row + 1)  # inclusive: the slot the step's first token wrote
        tile_rows = tl.arange(0, ROWS_TILE)  # query head h's token j is tile row h * QUERIES + j
        heads = tile_rows // QUERIES
        tokens = tile_rows % QUERIES
        last = end + tokens  # each query's last visible slot: its own
        dims = tl.arange(0, D_TILE)
        row_mask = (tile_rows < GROUP * QUERIES)[:, None]
        if D_TILE != D:  # a head size that is no power of two, padded with zeros (resolved at compile time)
            row_mask = row_mask & (dims < D)[None, :]
        head_offsets = (kv_head * GROUP + heads)[:, None]
        q_ptr = Q + row * stride_qb + head_offsets * stride_qh + tokens[:, None] * stride_qq + dims[None, :]
        q = tl.load(q_ptr, mask=row_mask, other=0.0)
        m = tl.full([ROWS_TILE], float("-inf"), tl.float32)
        total = tl.zeros([ROWS_TILE], tl.float32)
        acc = tl.zeros([ROWS_TILE, D_TILE], tl.float32)
        k_base = K + row * stride_kb + kv_head * stride_kh
        v_base = V + row * stride_vb + kv_head * stride_vh
        for first in range((start // BLOCK) * BLOCK, end + QUERIES, BLOCK):
            slots = first + tl.arange(0, BLOCK)
            inside = (slots >= start) & (slots < end + QUERIES)
            slot_mask = inside[:, None]
            if D_TILE != D:
                slot_mask = slot_mask & (dims < D)[None, :]
            k = tl.load(k_base + slots[:, None] * stride_kl + dims[None, :], mask=slot_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale
            # every query sees its row's first slot, which the first block holds, so no row of m stays -inf
            scores = tl.where(inside[None, :] & (slots[None, :] <= last[:, None]), scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slots[:, None] * stride_vl + dims[None, :], mask=slot_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / total[:, None]
        o_ptr = Out + row * stride_ob + tokens[:, None] * stride_oq + head_offsets * stride_oh + dims[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_mask)

    return ragged_kernel


def tile(size: int) -> int:
    """A tile's side for `size`: the next power of two, 16 at least (Triton's block shapes and tl.dot's minimum)."""
    return max(16, 1 << (size - 1).bit_length())


def ragged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor, scale: float,
                     block: int = BLOCK_N, warps: int = NUM_WARPS) -> torch.Tensor:
    """query [B, H, q, D] (q tokens a row, at consecutive slots); key, value [B, KV, L, D] (the cache, H a multiple of
    KV: query head h uses KV head h // (H // KV)); bounds [B, 2] (contiguous int64): row b's first slot and the slot of
    its first query token, token j attending slots bounds[b, 0]..bounds[b, 1] + j (a non-empty range). Returns
    [B, q, H, D], as transformers' attention functions do. `block` (slots per tile) and `warps` are the launch's tuning
    (docs/BENCHMARKS.md, "Regenerate throughput")."""
    rows, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"ragged attention takes query heads a multiple of the KV heads; got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}")
    if bounds.shape != (rows, 2) or not bounds.is_contiguous():
        raise ValueError(f"bounds must be a contiguous [{rows}, 2] tensor, got {tuple(bounds.shape)}")
    if key.stride(3) != 1 or value.stride(3) != 1 or query.stride(3) != 1:
        raise ValueError("query, key and value need contiguous head dimensions")
    group = heads // kv_heads
    out = torch.empty((rows, queries, heads, dim), dtype=query.dtype, device=query.device)
    _kernel()[(rows, kv_heads)](
        query, key, value, out, bounds, scale, *query.stride()[:3], *key.stride()[:3], *value.stride()[:3],
        *out.stride()[:3], GROUP=group, QUERIES=queries, ROWS_TILE=tile(group * queries), D=dim, D_TILE=tile(dim),
        BLOCK=block, num_warps=warps)
    return out
