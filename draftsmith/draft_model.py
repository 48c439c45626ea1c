"""Build and load speculators 0.3.0 EAGLE-3 draft models for a target."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from draftsmith.io import read_json
from draftsmith.target_model.spec import TargetSpec

FLEX_ATTENTION = "simple_flex_attention"  # speculators' registered attention function


def layer_config_for(target_config, draft_layers: int):
    """A LlamaConfig for the draft's decoder layers, shaped like the target's layers."""
    from transformers import LlamaConfig

    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=draft_layers,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", target_config.num_attention_heads),
        head_dim=head_dim,
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_theta=getattr(target_config, "rope_theta", 10000.0),
        rope_scaling=getattr(target_config, "rope_scaling", None),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    config._attn_implementation = FLEX_ATTENTION
    return config


def build_draft_config(target: TargetSpec, draft_vocab_size: int, draft_layers: int, aux_layer_ids: list[int],
                       num_speculative_tokens: int = 3):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    target_config = target.load_text_config()
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config_for(target_config, draft_layers),
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=True,  # as speculators 0.3.0's scripts/train.py
        target_hidden_size=target_config.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=num_speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=target.model, architectures=list(target_config.architectures or [])),
        ),
    )


def build_draft(target: TargetSpec, d2t: torch.Tensor, t2d: torch.Tensor, draft_layers: int, aux_layer_ids: list[int],
                num_speculative_tokens: int = 3, seed: int = 0):
    """A freshly initialised Eagle3DraftModel (embeddings and lm_head copied from the target)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    config = build_draft_config(target, int(d2t.shape[0]), draft_layers, aux_layer_ids, num_speculative_tokens)
    torch.manual_seed(seed)
    return Eagle3DraftModel(config, t2d=t2d, d2t=d2t)


def from_pretrained_works(model_class) -> bool:
    """speculators 0.3.0's `SpeculatorModel.from_pretrained` passes `verifier=` and
    `verifier_attachment_mode=` on to `Eagle3DraftModel.__init__`, which does not take them."""
    params = inspect.signature(model_class.__init__).parameters
    return "verifier" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def trained_speculative_tokens(draft_dir: str | Path) -> int:
    """The draft steps a checkpoint was trained for (its greedy proposal's speculative_tokens = ttt_steps)."""
    path = Path(draft_dir) / "config.json"
    methods = read_json(path).get("speculators_config", {}).get("proposal_methods") or [{}]
    steps = methods[0].get("speculative_tokens")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{path}: speculators_config.proposal_methods[0].speculative_tokens is {steps!r}; "
                         "set benchmark.num_speculative_tokens to an integer")
    return steps


def resolve_num_speculative_tokens(value, draft_dir: str | Path) -> int:
    """benchmark.num_speculative_tokens: an integer, or "auto" for the steps the draft was trained for."""
    return trained_speculative_tokens(draft_dir) if value == "auto" else int(value)


def load_draft(draft_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a trained draft checkpoint (config.json + model.safetensors) with speculators' classes."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    weights = load_file(Path(draft_dir) / "model.safetensors")
    d2t, t2d = weights["d2t"], weights["t2d"]
    if from_pretrained_works(Eagle3DraftModel):
        model = Eagle3DraftModel.from_pretrained(str(draft_dir), t2d=t2d, d2t=d2t, dtype=dtype)
    else:
        config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
        model = Eagle3DraftModel(config, t2d=t2d, d2t=d2t)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # verifier_lm_head is rebuilt from the target and never saved
        missing = [k for k in missing if k not in Eagle3DraftModel._keys_to_ignore_on_load_missing]
        if missing or unexpected:
            raise ValueError(f"{draft_dir}: checkpoint does not match its config (missing {missing}, unexpected {unexpected})")
    return model.to(device=device, dtype=dtype).eval()
