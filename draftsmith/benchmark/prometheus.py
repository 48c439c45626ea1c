"""vLLM's spec-decode counters from its Prometheus text exposition (`/metrics` of `vllm serve`)."""

from __future__ import annotations

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Samples of Prometheus text exposition: {(name, sorted label pairs): value}."""
    samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_text, value_text = rest.rsplit("}", 1)
            labels = tuple(sorted(_parse_labels(labels_text)))
        else:
            name, value_text = line.split(None, 1)
            labels = ()
        samples[(name.strip(), labels)] = float(value_text.split()[0])
    return samples


def _parse_labels(text: str):
    i = 0
    while i < len(text):
        eq = text.index("=", i)
        key = text[i:eq].strip().lstrip(",").strip()
        j, value = eq + 2, []  # skip ="
        while text[j] != '"':
            if text[j] == "\\":
                j += 1
                value.append({"n": "\n"}.get(text[j], text[j]))
            else:
                value.append(text[j])
            j += 1
        yield key, "".join(value)
        i = j + 1
        while i < len(text) and text[i] in ", ":
            i += 1


def spec_decode_counters(text: str, k: int) -> dict:
    """vLLM's spec-decode counters, summed over engines: drafts, draft_tokens, accepted, accepted_per_pos[k]."""
    samples = parse_prometheus(text)

    def total(name, **match):
        return sum(v for (n, labels), v in samples.items()
                   if n == f"{name}_total" and all(dict(labels).get(key) == val for key, val in match.items()))

    return {"drafts": total(DRAFTS), "draft_tokens": total(DRAFT_TOKENS), "accepted": total(ACCEPTED),
            "accepted_per_pos": [total(ACCEPTED_PER_POS, position=str(i)) for i in range(k)]}


def counter_delta(after: dict, before: dict) -> dict:
    return {key: [a - b for a, b in zip(after[key], before[key])] if isinstance(after[key], list) else after[key] - before[key]
            for key in after}
