"""What a run says on the console before its first job about a config that may not measure what the user expects."""

from __future__ import annotations

# The prompts benchmark.prompts names, other than a dataset spec.
PROMPT_SOURCES = {
    "heldout": "the synthetic corpus' held-out prompts",
    "mt_bench": "MT-Bench's questions",
}


def benchmark_prompts_notice(config: dict, files) -> str | None:
    """One line where the benchmark prompts are not from the user's own data (datasets of source local or hub):
    a draft is then measured on prompts unlike those it trained on, and its speed-up can fall far below what its
    validation predicts (tiny.yaml's held-out synthetic prompts: 2.76 predicted, 1.14 measured on a user's chats)."""
    from draftsmith.config.workflow import config_sources

    prompts = config["benchmark"]["prompts"]
    own = [name for name, spec in config["datasets"].items() if spec["source"] in ("local", "hub")]
    if not own or not isinstance(prompts, str):
        return None
    setters = [name for name, data in config_sources(files) if "prompts" in (data.get("benchmark") or {})]
    where = f"set in {setters[-1]}" if setters else "the default"
    names = ", ".join(repr(n) for n in own)
    return (f"benchmark prompts: {PROMPT_SOURCES[prompts]} (benchmark.prompts: {prompts}, {where}), not from your "
            f"datasets {names}; to measure the draft on prompts like yours, set benchmark.prompts to a dataset spec "
            "such as {source: local, path: your_prompts.jsonl}")
