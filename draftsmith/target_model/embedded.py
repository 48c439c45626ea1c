"""The embedded default target: a tokenizer trained on the synthetic corpus and a small
Llama-architecture model briefly pretrained on it, saved as a normal HF model directory.

It exists for fast tests and CPU smoke runs of the whole DAG. It knows only the synthetic corpus'
language, whatever the config's datasets are: it cannot model a user's text, and a draft trained for it
says nothing about a real model (corpus_mismatch_warning says so when no dataset is the synthetic one)."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Role markers are special tokens; each turn ends with <|end|>, which the loss mask includes
# so the draft learns to predict the end of an answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def corpus_mismatch_warning(datasets: dict) -> str | None:
    """The warning for an embedded target whose config trains on no synthetic dataset (None when one is)."""
    if any(spec.get("source") == "synthetic" for spec in datasets.values()):
        return None
    names = ", ".join(sorted(datasets)) or "none"
    return ('target.model is "embedded": the tiny target is pretrained on the synthetic corpus only, and no dataset '
            f"here has source: synthetic (datasets: {names}). Its tokenizer and weights know only the synthetic "
            "corpus' language and cannot model your text, so a draft trained on it says nothing about a real model. "
            "It is for fast tests and CPU smoke runs of the whole DAG; for a real draft, set target.model to your "
            "model (a hub id or a local model directory)")


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|eos|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 16
    fast.save_pretrained(out_dir)
    return fast


def build_model(tokenizer, cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"],
        num_key_value_heads=cfg["num_kv_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def _packed_batches(token_stream: list[int], seq_len: int, batch_size: int, rng: random.Random):
    n_seq = len(token_stream) // seq_len
    if n_seq < 1:
        raise ValueError(f"pretraining corpus has {len(token_stream)} tokens, fewer than seq_len={seq_len}")
    data = torch.tensor(token_stream[: n_seq * seq_len]).view(n_seq, seq_len)
    while True:
        idx = [rng.randrange(n_seq) for _ in range(batch_size)]
        yield data[idx]


def pretrain(model, tokenizer, conversations: list[list[dict]], cfg: dict, seed: int) -> list[float]:
    """Next-token pretraining on the rendered conversations (bf16 autocast on a GPU); returns the loss per step."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    stream: list[int] = []
    for messages in conversations:
        stream += tokenizer.apply_chat_template(messages, tokenize=True)
    steps, lr = cfg["pretrain_steps"], cfg["pretrain_lr"]
    warmup = max(1, steps // 20)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    batches = _packed_batches(stream, cfg["pretrain_seq_len"], cfg["pretrain_batch_size"], rng)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="pretrain target", mininterval=5)
    for step in bar:
        batch = next(batches).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            log.info("pretrain step %d loss %.4f", step, losses[-1])
    model.to("cpu").eval()
    return losses


def build_embedded_target(conversations: list[list[dict]], cfg: dict, seed: int, out_dir: Path) -> dict:
    """Train tokenizer + model into `out_dir` (which should be a temporary directory)."""
    texts = [m["content"] for conv in conversations for m in conv]
    tokenizer = train_tokenizer(texts, cfg["vocab_size"], out_dir)
    torch.manual_seed(seed)
    model = build_model(tokenizer, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("embedded target: %d parameters, vocab %d", n_params, len(tokenizer))
    losses = pretrain(model, tokenizer, conversations, cfg, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return {
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "pretrain_loss_first": losses[0],
        "pretrain_loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "pretrain_steps": len(losses),
    }
