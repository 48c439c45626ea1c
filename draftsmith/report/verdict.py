"""The report's opening: whether to use the trained draft, how sure that is, and the next step.

Speed claims rest on the benchmark's repeated, interleaved runs (draftsmith.benchmark.results): each method's
speedup over target-only greedy has a range, the lowest and highest speedup of a single run over all prompts.
Two methods are ranked only where their ranges are apart; where they overlap, the runs disagree by more than the
methods differ, and the report says the machine was too noisy to rank them instead of printing a ranking.
Target-only greedy is its own baseline: its speedup is 1 in every run. Acceptance (tokens per target forward) is
counted, not timed: greedy decoding gives the same counts on every run, so acceptance comparisons need no range.

The validation accuracies of training predict the acceptance the benchmark should see: speculators' `full_acc_i`
is the fraction of validation positions whose draft tokens of TTT steps 0..i were all the target's greedy tokens
(cumulative, a_i = c_0 c_1 ... c_i in conditional accuracies c), the quantity per-position acceptance i + 1 measures
while decoding. So a drafted round is predicted to yield 1 + a_0 + ... + a_(k-1) tokens (1 + c_0 + c_0 c_1 + ...):
draftsmith.training.acceptance, the formula training's metrics use too.
"""

from __future__ import annotations

import math

import pandas as pd

from draftsmith.artefacts import BUILT_TARGETS
from draftsmith.benchmark.results import BASELINE
from draftsmith.report.methods import PROMPT_LOOKUP as LOOKUP
from draftsmith.report.methods import TRAINED_DRAFT as DRAFT
from draftsmith.report.methods import method_label, method_order, other_drafting
from draftsmith.report.tables import fmt
from draftsmith.training.acceptance import predicted_acceptance_length

# acceptance gained between the smallest and largest training set below which more of the same data "bought nothing"
DATA_GAIN = 0.02
# measured tokens per drafted round below this share of validation's prediction: a gap worth a word
GAP = 0.8
# a last draft position still accepted this often suggests a longer chain
LONGER_K = 0.5
# a position accepted less often than this is not worth a draft step (when the step cost c is unknown)
SHORTER_K = 0.1


def _known(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def interval(row: dict) -> tuple[float, float] | None:
    """A method's speedup range over the timed runs; (1, 1) for the baseline; None where one run was timed."""
    if row["method"] == BASELINE:
        return (1.0, 1.0)
    low, high = row.get("speedup_low"), row.get("speedup_high")
    return (float(low), float(high)) if _known(low) and _known(high) else None


def compare(a: dict, b: dict) -> str:
    """'faster', 'slower' (ranges apart), 'noisy' (ranges overlap) or 'unmeasured' (a single timed run)."""
    ia, ib = interval(a), interval(b)
    if ia is None or ib is None:
        return "unmeasured"
    if ia[0] > ib[1]:
        return "faster"
    if ia[1] < ib[0]:
        return "slower"
    return "noisy"


def _speed(row: dict) -> str:
    """'1.23× (runs 1.10–1.30×)'."""
    text = f"{fmt(row['speedup'], 2)}×"
    iv = interval(row)
    if row["method"] != BASELINE and iv is not None:
        text += f" (runs {fmt(iv[0], 2)}–{fmt(iv[1], 2)}×)"
    return text


def ranking_line(variant: str, backend: str, rows: list[dict]) -> str:
    """The methods of one variant ranked by speed, or why they cannot be ranked."""
    rows = [r for r in rows if _known(r["speedup"])]
    if len(rows) < 2:
        return f"Speed ranking of `{variant}`: fewer than two timed methods, nothing to rank."
    ordered = sorted(rows, key=lambda r: -r["speedup"])
    runs = min(int(r.get("repeats") or 1) for r in rows)
    pairs = [(a, b, compare(a, b)) for a, b in zip(ordered, ordered[1:])]
    if any(c == "unmeasured" for *_, c in pairs):
        return (f"Speed order of `{variant}` by a single timed run per method ({backend} backend; unconfirmed: the "
                f"spread was not measured): " + " > ".join(f"{method_label(r['method'])} {fmt(r['speedup'], 2)}×"
                                                      for r in ordered) + ".")
    close = [(a, b) for a, b, c in pairs if c == "noisy"]
    if close:
        spreads = [r["time_spread"] for r in rows if _known(r.get("time_spread"))]
        spread = (f"; a method's runs on one prompt differed by a median of "
                  f"{fmt(100 * pd.Series(spreads).median(), 0)}% of their time" if spreads else "")
        overlaps = "; ".join(f"{method_label(a['method'])} {_speed(a)} and {method_label(b['method'])} {_speed(b)}"
                             for a, b in close)
        return (f"**Too noisy to rank** the methods of `{variant}` by speed: over {runs} timed runs per prompt, the "
                f"speedup ranges overlap ({overlaps}){spread}. Re-run the benchmark on a quiet machine or with more "
                f"runs (`benchmark.repeats`) before choosing by speed.")
    return (f"Speed ranking of `{variant}` (speedup over target-only greedy, and its range over {runs} timed runs per "
            f"prompt, each range apart from the next): " + " > ".join(
                f"{method_label(r['method'])} {_speed(r)}" for r in ordered) + ".")


def _sureness(a: dict, b: dict) -> str:
    """How a's speed compares with b's, and how sure that is: 'faster by 25%, the speedup ranges apart'."""
    ratio = a["speedup"] / b["speedup"] if b["speedup"] else math.nan
    how = compare(a, b)
    pct = fmt(abs(ratio - 1) * 100, 0)
    if how in ("faster", "slower"):
        return f"{how} by {pct}%, the speedup ranges apart"
    if how == "noisy":
        return "too noisy to tell: the speedup ranges overlap"
    return f"{'faster' if ratio > 1 else 'slower'} by {pct}% in a single timed run; the spread was not measured"


def _head(draft: dict, lookup: dict | None, vs_base: str, vs_lookup: str | None) -> str:
    """The verdict in a few words, from the comparisons with target-only greedy and prompt lookup."""
    if vs_base == "unmeasured" or vs_lookup == "unmeasured":
        fastest = draft["speedup"] > 1 and (lookup is None or draft["speedup"] > lookup["speedup"])
        use = "use this draft" if fastest else "do not use this draft"
        return f"{use}, unconfirmed: one timed run per method, so the machine's noise was not measured"
    if vs_base == "slower":
        return "do not use this draft: it slows decoding down"
    if vs_lookup == "slower":
        return "prompt lookup is the better choice: it is faster than this draft and needs no training"
    if vs_base == "noisy":
        return "undecided: the machine was too noisy to tell whether this draft is faster than target-only greedy"
    if vs_lookup == "noisy":
        return "this draft speeds decoding up; whether more than prompt lookup, the runs were too noisy to tell"
    return "use this draft: it speeds decoding up" + ("" if vs_lookup is None else ", more than prompt lookup does")


def best_k(per_position: list, k: int, cost_ratio) -> tuple[int, float | None]:
    """The chain length the measured acceptance favours: with the step cost c, the j <= k that maximises the cost
    model's (1 + p_1 + ... + p_j) / (1 + j c); without it, the last position accepted in >= SHORTER_K of drafts.
    Returns (j, the cost model's gain of j over k) - the gain is None without c."""
    p = [x if _known(x) else 0.0 for x in per_position[:k]]
    if not p:
        return k, None
    if _known(cost_ratio):
        score = [(1 + sum(p[:j])) / (1 + j * cost_ratio) for j in range(1, len(p) + 1)]
        j = max(range(len(score)), key=score.__getitem__) + 1
        return j, score[j - 1] / score[-1]
    useful = [i + 1 for i, x in enumerate(p) if x >= SHORTER_K]
    return (max(useful) if useful else 1), None


def predicted_table(training: pd.DataFrame, methods: pd.DataFrame, summaries: dict) -> pd.DataFrame:
    """Per variant: validation accuracy per TTT step beside the benchmark's per-position acceptance, and the tokens per
    drafted round each gives."""
    rows = []
    acc_cols = sorted((c for c in training.columns if c.startswith("val full acc ")), key=lambda c: int(c.split()[-1]))
    by_variant = training.set_index("variant") if len(training) else training
    for r in methods[methods["method"] == DRAFT].to_dict("records"):  # in variant order (build_report)
        variant = r["variant"]
        k = summaries[variant].get("num_speculative_tokens") or len(r["per_position_acceptance"] or [])
        accs = [by_variant.loc[variant, c] for c in acc_cols] if variant in by_variant.index else []
        accs = [float(a) for a in accs if _known(a)]
        rows.append({
            "variant": variant,
            "validation full accuracy per TTT step": accs or None,
            "predicted tokens per drafted round": predicted_acceptance_length(accs, k),
            "per-position acceptance (benchmark)": r["per_position_acceptance"],
            "tokens per drafted round (benchmark)": r["tokens_per_drafted_round"],
        })
    return pd.DataFrame(rows, columns=["variant", "validation full accuracy per TTT step",
                                       "predicted tokens per drafted round", "per-position acceptance (benchmark)",
                                       "tokens per drafted round (benchmark)"])


def _data_step(variant: str, data_size: pd.DataFrame) -> str:
    mine = data_size[data_size["variant"] == variant]
    same = data_size.dropna(subset=["acceptance length"])
    if len(mine):
        same = same[same["datasets"] == mine.iloc[0]["datasets"]]
    points = same.sort_values("train tokens")
    if points["train tokens"].nunique() >= 2:
        small, large = points.iloc[0], points.iloc[-1]
        gain = large["acceptance length"] - small["acceptance length"]
        curve = (f"acceptance {fmt(small['acceptance length'], 2)} from {fmt(int(small['train tokens']))} training "
                 f"tokens (`{small['variant']}`), {fmt(large['acceptance length'], 2)} from "
                 f"{fmt(int(large['train tokens']))} (`{large['variant']}`)")
        if gain > DATA_GAIN:
            return f"more data: the learning curve still rises ({curve}), so train on more of it"
        return (f"not more of the same data: it bought nothing here ({curve}); compare validation's prediction with "
                f"the benchmark (above) first, or train on broader data")
    tokens = f"{fmt(int(mine.iloc[0]['train tokens']))} tokens" if len(mine) else "its data"
    return (f"more data: this draft trained on {tokens}; add a variant with `data_fraction: 0.5` to draw the learning "
            f"curve and see what more data buys")


def _against_greedy(speedup, gain: float, k: int) -> str:
    """Whether the gain of another k would make the draft beat target-only greedy: the measured speedup at k times
    the cost model's gain."""
    if not _known(speedup):
        return ""
    at_j = speedup * gain
    verdict = ("faster than target-only greedy" if at_j > 1 else
               "still slower than target-only greedy: a shorter chain alone does not make this draft pay")
    return f", about {fmt(at_j, 2)}× target-only greedy ({fmt(speedup, 2)}× measured at k = {k}): {verdict}"


def next_step(variant: str, draft: dict, k: int, data_size: pd.DataFrame, noisy: bool) -> str:
    steps = []
    if noisy:
        steps.append("re-run the benchmark on a quiet machine or with more runs (`benchmark.repeats`) to settle the "
                     "speed comparison")
    per_position = draft.get("per_position_acceptance") or []
    j, gain = best_k(per_position, k, draft.get("cost_ratio"))
    if j < k:
        why = (f"the cost model τ/(1+k·c) with c = {fmt(draft['cost_ratio'], 3)} gives {fmt(gain, 2)}× the speed of "
               f"k = {k}{_against_greedy(draft['speedup'], gain, k)}" if gain is not None
               else f"positions past {j} accept under {fmt(SHORTER_K, 1)} of drafts")
        steps.append(f"another k: `benchmark.num_speculative_tokens: {j}` (per-position acceptance "
                     f"{fmt(per_position, 3)}; {why})")
    elif per_position and _known(per_position[-1]) and per_position[-1] >= LONGER_K:
        steps.append(f"another k: a longer chain, `benchmark.num_speculative_tokens: {k + 1}` (position {k} still "
                     f"accepts {fmt(per_position[-1], 2)} of drafts; train with `training.ttt_steps: {k + 1}`)")
    steps.append(_data_step(variant, data_size))
    return "; ".join(steps)


def verdict_lines(summaries: dict, methods: pd.DataFrame, predicted: pd.DataFrame,
                  data_size: pd.DataFrame) -> list[tuple[str, str, list[str]]]:
    """Per variant in the config's order: (variant, the verdict on its trained draft in one line with its acceptance
    and speedup, its grounds: speed against target-only greedy and prompt lookup, the speed ranking (or why there is
    none), acceptance, validation's prediction against the measurement, and the next step)."""
    out = []
    for variant, s in summaries.items():  # in the config's order (build_report)
        rows = {r["method"]: r for r in methods[methods["variant"] == variant].to_dict("records")}
        ranking = ranking_line(variant, s["backend"], [rows[m] for m in method_order(rows)])
        draft, base, lookup = rows.get(DRAFT), rows.get(BASELINE), rows.get(LOOKUP)
        if draft is None or base is None or not _known(draft["speedup"]):
            out.append((variant, f"**`{variant}`: no verdict**: the benchmark has no timed trained draft ({DRAFT}) "
                                 f"beside target-only greedy.", [ranking]))
            continue
        if lookup is not None and not _known(lookup["speedup"]):
            lookup = None
        vs_base = compare(draft, base)
        vs_lookup = compare(draft, lookup) if lookup is not None else None
        runs = int(draft.get("repeats") or 1)
        how = (f"{fmt(int(draft['prompts']))} prompts, {runs} timed runs each (median), the methods interleaved"
               if runs > 1 else f"{fmt(int(draft['prompts']))} prompts, one timed run each")
        speed = (f"Speed: the trained draft ran at {_speed(draft)} the speed of target-only greedy "
                 f"({_sureness(draft, base)})")
        if lookup is not None:
            speed += (f"; prompt lookup ran at {_speed(lookup)}, so the draft ran at "
                      f"{fmt(draft['speedup'] / lookup['speedup'], 2)}× its speed ({_sureness(draft, lookup)})")
        speed += f". Measured on {how}, on {s['device']}."
        others = [f"{fmt(rows[m]['acceptance_length'], 2)} with {method_label(m)}" for m in other_drafting(rows)]
        accept = (f"Acceptance (counted, not timed, so no machine noise): {fmt(draft['acceptance_length'], 2)} tokens "
                  f"per target forward" + (f" vs {', '.join(others)}" if others else "") + ".")
        grounds = [speed, ranking, accept]
        pred = predicted[predicted["variant"] == variant]
        if len(pred) and _known(pred.iloc[0]["predicted tokens per drafted round"]):
            p = pred.iloc[0]
            measured = p["tokens per drafted round (benchmark)"]
            text = (f"Validation predicted {fmt(p['predicted tokens per drafted round'], 2)} tokens per drafted round "
                    f"(1 + the validation full accuracies {fmt(p['validation full accuracy per TTT step'], 3)}); the "
                    f"benchmark measured {fmt(measured, 2)} (per-position acceptance "
                    f"{fmt(p['per-position acceptance (benchmark)'], 3)}).")
            if _known(measured) and measured < GAP * p["predicted tokens per drafted round"]:
                text += (" The gap is not noise (both are counts): the benchmark prompts differ from the training data, "
                         "or training and decoding disagree (layers, vocabulary map, chat template).")
            grounds.append(text)
        k = int(s.get("num_speculative_tokens") or len(draft.get("per_position_acceptance") or []) or 1)
        noisy = "noisy" in (vs_base, vs_lookup)
        grounds.append(f"Next step: {next_step(variant, draft, k, data_size, noisy)}.")
        out.append((variant, f"**`{variant}`: {_head(draft, lookup, vs_base, vs_lookup)}** (acceptance "
                    f"{fmt(draft['acceptance_length'], 2)} tokens per target forward, {fmt(draft['speedup'], 2)}× the "
                    f"speed of target-only greedy).", grounds))
    return out


# what a draft is worth on a real model, measured (README.md, "What it gets on a real model"; docs/BENCHMARKS.md)
GPU_RESULT = ("SmolLM2-135M-Instruct's draft trained on 11M tokens accepts 2.03 tokens per target forward and runs at "
              "1.54× target-only greedy on one H100")


def cpu_demo_note(summaries: dict, config: dict) -> str | None:
    """For a run on the workflow's own small target (the embedded default or config/tiny.yaml's) benchmarked on a CPU:
    that a slow draft is expected there, and where the GPU result is; None for any other run."""
    model = (config.get("target") or {}).get("model")
    if model not in BUILT_TARGETS or not summaries or not all(
            str(s.get("device", "")).startswith("cpu") for s in summaries.values()):
        return None
    return (f"This is a CPU demo run (target `{model}`, built by the workflow, benchmarked on a CPU, trained on little "
            f"data): a draft slower than target-only greedy is expected here, and a faster one says as little. It "
            f"shows every stage working end to end, not what a draft is worth: on a GPU with enough data, {GPU_RESULT} "
            f"(README.md, \"What it gets on a real model\"; docs/BENCHMARKS.md).")
