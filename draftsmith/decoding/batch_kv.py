"""The static KV cache of batched decoding (`BatchKV`: B rows, each its own slots), its masks, and the attention
functions the engine registers with transformers.

Attention (`grouped_sdpa`, registered with transformers as `draftsmith_grouped_sdpa`) hands the KV heads to
SDPA unrepeated: the query heads that share a KV head become extra query rows of it. transformers' own SDPA path
copies every KV head to each of its query heads once a mask is given, and at a large batch those copies, not the
matrix products, are what a decode step's time goes to.
`ragged` (`draftsmith_ragged`) reads each row's own slots instead (draftsmith.decoding.ragged_attention).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface

GROUPED_SDPA = "draftsmith_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """SDPA with grouped-query attention as extra query rows: query [B, H, q, D], key/value [B, KV, S, D],
    mask [B, 1, q, S] (boolean, True = attend). Returns [B, q, H, D] as transformers' attention functions do."""
    b, heads, q, d = query.shape
    kv = key.shape[1]
    group = heads // kv
    query = query.reshape(b, kv, group * q, d)
    mask = None if attention_mask is None else attention_mask[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.view(b, kv, group, q, d).reshape(b, heads, q, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)

RAGGED = "draftsmith_ragged"


def ragged(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """A step's attention over each row's own slots (draftsmith.decoding.ragged_attention): `attention_mask` is not a
    mask but each row's first slot and its first query's, [B, 1, 1, 2] (4-D, so transformers passes it through)."""
    from draftsmith.decoding.ragged_attention import ragged_attention

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return ragged_attention(query, key, value, attention_mask.view(-1, 2), scale), None


AttentionInterface.register(RAGGED, ragged)


def ragged_bounds(first: torch.Tensor, query_slot: torch.Tensor) -> torch.Tensor:
    """What `ragged` takes for a mask: each row's first slot [B] and its first query's slot [B], as [B, 1, 1, 2]."""
    return torch.stack((first, query_slot), -1)[:, None, None, :]


def attention_configs(model) -> list:
    """Every config the model's attention layers read their implementation from (a multimodal model nests one)."""
    return list({id(m.config): m.config for m in model.modules()
                 if hasattr(getattr(m, "config", None), "_attn_implementation")}.values())


@contextmanager
def grouped_attention(configs: list, implementation: str = GROUPED_SDPA):
    """`grouped_sdpa` (or `implementation`) as the attention of `configs` (attention_configs) within the block,
    their own after it."""
    implementations = [c._attn_implementation for c in configs]
    for config in configs:
        config._attn_implementation = implementation
    try:
        yield
    finally:
        for config, implementation in zip(configs, implementations):
            config._attn_implementation = implementation


def row_mask(query_slots: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean SDPA mask [rows, 1, q, length] (True = attend) of each row's queries at `query_slots` [rows, q] over
    a cache of `length` slots, the row's sequence starting at slot `starts[row]` (left padding before it): a query
    sees the row's slots from its start up to its own. A padding query (below its row's start) sees only itself, so
    that no mask row is empty (an empty one gives NaN, which a masked slot still spreads: 0 * NaN)."""
    keys = torch.arange(length, device=query_slots.device)[None, None, :]
    query = query_slots[:, :, None]
    return ((keys <= query) & ((keys >= starts[:, None, None]) | (keys == query)))[:, None]


def prefill_layout(starts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill of left-padded prompts `width` wide (each starting at `starts[row]`) at slots 0..width-1: the slots
    [width], the mask [rows, 1, width, width] (causal within each prompt from its start; a padding position attends to
    itself: finite, never read) and the position ids [rows, width] (slot - start, 0 on the padding)."""
    slots = torch.arange(width, device=starts.device)
    mask = row_mask(slots.expand(len(starts), width), starts, width)
    return slots, mask, (slots[None, :] - starts[:, None]).clamp(min=0)


def on_device(values, device: torch.device) -> torch.Tensor:
    """`values` (a list of ints or a CPU tensor) on `device` without waiting for it. A blocking host-to-device copy
    (`.to(device)`, `torch.tensor(..., device=...)`, and `x[rows] = 0`, which copies the 0) waits for the stream's
    queued work, so each one in the decode loop held the host until the window of steps in flight had run, and the
    device then idled while the host refilled: measured on one H100, 7.1 of 10.5 s went to such waits. A copy from
    pinned memory is queued like a kernel."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class BatchKV:
    """The static KV cache of `rows` sequences, `length` slots each, for transformers' attention layers.

    Two kinds of write: a prefill of some rows (`prefill_rows`, the prompt at slots 0..P-1, attending only to
    itself), and q tokens of every row at its own slots (`write_slots` [rows, q], attending to the whole cache through
    the caller's mask, or to each row's own slots through `ragged`; the engine's rounds, draftsmith.decoding.engine).
    """

    def __init__(self, rows: int, length: int):
        self.rows, self.length = rows, length
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.prefill_rows: torch.Tensor | None = None
        self.write_slots: torch.Tensor | None = None
        self._all_rows: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs: dict | None = None):
        if layer_idx not in self.keys:
            shape = (self.rows, key.shape[1], self.length, key.shape[3])
            self.keys[layer_idx] = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=value.dtype, device=value.device)
            self._all_rows = torch.arange(self.rows, device=key.device)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.prefill_rows is not None:
            width = key.shape[2]
            keys[self.prefill_rows, :, :width] = key
            values[self.prefill_rows, :, :width] = value
            return key, value
        keys[self._all_rows[:, None], :, self.write_slots] = key.transpose(1, 2)  # [rows, q, KV, D] at each row's slots
        values[self._all_rows[:, None], :, self.write_slots] = value.transpose(1, 2)
        return keys, values

    @contextmanager
    def writing(self, prefill_rows: torch.Tensor | None = None, write_slots: torch.Tensor | None = None):
        """Within the block a forward writes the prompts of rows `prefill_rows`, or every row's `write_slots`."""
        self.prefill_rows, self.write_slots = prefill_rows, write_slots
        try:
            yield self
        finally:
            self.prefill_rows, self.write_slots = None, None

    def copy_rows(self, sources: torch.Tensor, targets: torch.Tensor, width: int) -> None:
        """Slots 0..width-1 of rows `sources` into rows `targets`, in every layer (a prefill shared by a repeated
        prompt's rows)."""
        for layer in self.keys:
            self.keys[layer][targets, :, :width] = self.keys[layer][sources, :, :width]
            self.values[layer][targets, :, :width] = self.values[layer][sources, :, :width]
