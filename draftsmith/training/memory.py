"""What online training holds in memory on its device, estimated from the target's config (no weights loaded).

An estimate for preflight's choice between online and offline hidden states, not an allocator's account: the
target's weights and one forward batch of its activations (no gradients), and the draft's float32 weights, gradients
and AdamW moments with the activations of one packed batch over its TTT steps, on a GPU the states of the batches
loaded ahead (draftsmith.training.prefetch), plus a margin for the allocator.
"""

from __future__ import annotations

ONLINE_PREFETCH_BATCHES = 2  # online batches loaded ahead of the step on a GPU (sources.OnlineStates, prefetch.py)

MARGIN = 1.25  # fragmentation, CUDA context, kernels' workspaces
CONTEXT_BYTES = 600 * 2**20


def target_parameters(text: dict) -> int:
    h, layers = text["hidden_size"], text["num_hidden_layers"]
    inter, heads = text.get("intermediate_size", 4 * h), text.get("num_attention_heads", 1)
    kv_dim = text.get("num_key_value_heads", heads) * text.get("head_dim", h // heads)
    attention = h * heads * text.get("head_dim", h // heads) * 2 + 2 * h * kv_dim
    embeddings = text["vocab_size"] * h * (1 if text.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * (attention + 3 * h * inter)


def online_training_bytes(text: dict, training: dict, extraction: dict, draft_vocab_size: int, on_gpu: bool) -> dict:
    """Bytes by part: target weights, target activations, draft state, draft activations, and their total."""
    h = text["hidden_size"]
    inter = text.get("intermediate_size", 4 * h)
    element = {"float32": 4, "bfloat16": 2, "float16": 2}.get(extraction["dtype"], 2 if on_gpu else 4)
    tokens = extraction["batch_tokens"]
    parts = {
        "target weights": target_parameters(text) * element,
        # one decoder layer's working set at a time (no cache, no grad), and the four captured states
        "target activations": tokens * (6 * h + 2 * inter + 4 * h) * element,
        # a draft layer takes [embedding, fc(aux states)] (2h) into attention; fc is 3h -> h; its own lm_head
        "draft weights and optimizer": 16 * training["draft_layers"] * (6 * h * h + 3 * h * inter)
        + 16 * (3 * h * h + draft_vocab_size * h) + 4 * text["vocab_size"] * h,
        "draft activations": 4 * training["total_seq_length"] * training["ttt_steps"] * (24 * h + 4 * inter
                                                                                          + 3 * draft_vocab_size)
        + 2 * 4 * training["total_seq_length"] * 4 * h,
        # float32 states (three auxiliary layers and the last) of each batch waiting for its step
        "batches loaded ahead": (ONLINE_PREFETCH_BATCHES if on_gpu else 0) * training["total_seq_length"] * 4 * h * 4,
    }
    parts["total"] = int(MARGIN * sum(parts.values())) + (CONTEXT_BYTES if on_gpu else 0)
    return parts
