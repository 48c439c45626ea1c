"""One description of the target model, built once by the workflow and handed to every stage that loads it.

`trust_remote_code` runs Python code from the model repository: it is off unless the config opts in. Each loader
checks first (draftsmith.target_model.remote_code): a target that needs its own code while it is off stops with an
error naming `target.trust_remote_code`, not transformers' own.
`dtype` is the target's default dtype; a stage's own dtype setting (extraction.dtype, benchmark.dtype)
overrides it where that is not "auto".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from draftsmith.target_model.layers import text_config
from draftsmith.target_model.remote_code import remote_code_checked


@dataclass(frozen=True)
class TargetSpec:
    model: str  # a local model directory or a hub id
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"

    @classmethod
    def from_dict(cls, spec: dict) -> "TargetSpec":
        # rules that read only the tokenizer or config.json get no dtype (rules/common.smk TARGET_FILES_SPEC)
        return cls(model=str(spec["model"]), revision=spec["revision"], trust_remote_code=spec["trust_remote_code"],
                   dtype=spec.get("dtype", "auto"))

    def to_dict(self) -> dict:
        return asdict(self)

    def stage_dtype(self, dtype: str) -> str:
        return self.dtype if dtype == "auto" else dtype

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        with remote_code_checked(self.model, self.trust_remote_code):
            tokenizer = AutoTokenizer.from_pretrained(self.model, trust_remote_code=self.trust_remote_code,
                                                      revision=self.revision)
        if tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer of {self.model} has no chat template; draftsmith needs one to render conversations")
        return tokenizer

    def load_text_config(self):
        from transformers import AutoConfig

        with remote_code_checked(self.model, self.trust_remote_code):
            return text_config(AutoConfig.from_pretrained(self.model, trust_remote_code=self.trust_remote_code,
                                                          revision=self.revision))

    def load_causal_lm(self, dtype):
        """The target as a transformers causal LM (SDPA attention), on the CPU in `dtype` (a torch.dtype)."""
        from transformers import AutoModelForCausalLM

        with remote_code_checked(self.model, self.trust_remote_code):
            return AutoModelForCausalLM.from_pretrained(self.model, dtype=dtype, trust_remote_code=self.trust_remote_code,
                                                        revision=self.revision, attn_implementation="sdpa")

    def load_generation_config(self):
        """The generation config transformers gives the loaded model (its generation_config.json, else one made from
        config.json), without loading weights: the stop tokens of both regenerate backends come from it."""
        from transformers import AutoConfig, GenerationConfig

        try:
            return GenerationConfig.from_pretrained(self.model, revision=self.revision)
        except OSError:  # no generation_config.json
            with remote_code_checked(self.model, self.trust_remote_code):
                return GenerationConfig.from_model_config(AutoConfig.from_pretrained(
                    self.model, trust_remote_code=self.trust_remote_code, revision=self.revision))

    def fingerprint(self) -> dict:
        from draftsmith.provenance import model_fingerprint

        return {**model_fingerprint(self.model), "revision": self.revision}


def stop_token_ids(tokenizer, model) -> set[int]:
    """The tokenizer's eos token, plus any the target's generation config adds (chat models often end turns there).
    `model`: the loaded model, or its generation config (TargetSpec.load_generation_config)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = model if isinstance(model, GenerationConfig) else getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else ({extra} if extra is not None else set())
    ids.discard(None)
    if not ids:
        raise ValueError("the target's tokenizer has no eos token; generation would only stop at max_new_tokens")
    return ids
