"""The report's verdict and speed ranking on hand-made benchmark summaries: a ranking only where the timed runs' speedup
ranges are apart, "too noisy to rank" where they overlap, and a single timed run (the vLLM backend) read as unconfirmed."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from draftsmith.io import write_json
from draftsmith.report.load import load_summaries
from draftsmith.report.render import render_html, render_markdown
from draftsmith.report.tables import acceptance_by_category, category_findings
from draftsmith.report.verdict import best_k, predicted_table, verdict_lines
from draftsmith.training.acceptance import predicted_acceptance_length

K = 3
DATA_SIZE = pd.DataFrame([{"variant": "v", "datasets": "all", "data fraction": 1.0, "train samples": 100,
                           "train tokens": 8000, "acceptance length": 1.3}])


def method(speedup, low=None, high=None, acceptance=1.0, per_position=(None, None, None), spread=0.05, repeats=3,
           cost_ratio=None) -> dict:
    entry = {"prompts": 6, "acceptance_length": acceptance, "per_position_acceptance": list(per_position),
             "tokens_per_drafted_round": 1 + sum(p or 0 for p in per_position) if per_position[0] is not None else None,
             "tokens_per_s": 10 * speedup, "speedup": speedup, "repeats": repeats,
             "time_spread": spread if repeats > 1 else None,
             "speedup_range": [low, high] if low is not None else None}
    if cost_ratio is not None:
        entry["step_costs"] = {"cost_ratio": cost_ratio}
    return entry


def summary(methods: dict, backend="offline") -> dict:
    return {"variant": "v", "backend": backend, "device": "cpu: test (2 cores)", "num_speculative_tokens": K,
            "methods": methods}


def load(tmp_path, s: dict):
    write_json(tmp_path / "summary.json", s)
    return load_summaries([tmp_path / "summary.json"])


CLEAR = {"target_greedy": method(1.0, 1.0, 1.0),
         "prompt_lookup": method(1.2, 1.15, 1.25, acceptance=1.3, per_position=(0.2, 0.07, 0.03)),
         "untrained_draft": method(0.8, 0.78, 0.82, acceptance=1.02, per_position=(0.02, 0.0, 0.0)),
         "eagle3_draft": method(1.5, 1.45, 1.55, acceptance=2.1, per_position=(0.6, 0.35, 0.15), cost_ratio=0.05)}
# the issue's shared machine: one run of one prompt 30x slower; the runs' speedups disagree by more than the methods
NOISY = {"target_greedy": method(1.0, 1.0, 1.0, spread=2.4),
         "prompt_lookup": method(1.25, 0.9, 7.82, acceptance=1.27, per_position=(0.2, 0.05, 0.02), spread=2.4),
         "untrained_draft": method(1.1, 0.85, 5.1, acceptance=1.01, per_position=(0.01, 0.0, 0.0), spread=2.4),
         "eagle3_draft": method(1.05, 0.95, 3.3, acceptance=1.34, per_position=(0.338, 0.0, 0.0), spread=2.4,
                                cost_ratio=0.3)}


def test_apart_ranges_give_a_ranking_and_a_verdict_with_numbers(tmp_path):
    by_variant, methods = load(tmp_path, summary(CLEAR))
    [(_, head, grounds)] = verdict_lines(by_variant, methods, predicted_table(pd.DataFrame(), methods, by_variant),
                                      DATA_SIZE)
    assert head == ("**`v`: use this draft: it speeds decoding up, more than prompt lookup does** (acceptance 2.10 "
                    "tokens per target forward, 1.50× the speed of target-only greedy).")
    speed, ranking, accept, step = grounds
    assert "ran at 1.50× (runs 1.45–1.55×) the speed of target-only greedy (faster by 50%, the speedup ranges apart)" \
        in speed
    assert "prompt lookup ran at 1.20× (runs 1.15–1.25×), so the draft ran at 1.25× its speed (faster by 25%" in speed
    assert "6 prompts, 3 timed runs each (median), the methods interleaved" in speed
    assert ranking == ("Speed ranking of `v` (speedup over target-only greedy, and its range over 3 timed runs per "
                       "prompt, each range apart from the next): trained EAGLE-3 draft 1.50× (runs 1.45–1.55×) > prompt "
                       "lookup 1.20× (runs 1.15–1.25×) > target-only greedy 1.00× > untrained draft 0.80× "
                       "(runs 0.78–0.82×).")
    assert "2.10 tokens per target forward vs 1.30 with prompt lookup, 1.02 with untrained draft" in accept
    assert step.startswith("Next step: more data: this draft trained on 8,000 tokens; add a variant with "
                           "`data_fraction: 0.5`")


def test_overlapping_ranges_say_too_noisy_and_print_no_ranking(tmp_path):
    by_variant, methods = load(tmp_path, summary(NOISY))
    verdict = verdict_lines(by_variant, methods, predicted_table(pd.DataFrame(), methods, by_variant), DATA_SIZE)
    [(variant, head, grounds)] = verdict
    assert variant == "v"
    assert head.startswith("**`v`: undecided: the machine was too noisy to tell whether this draft is faster than "
                           "target-only greedy** (acceptance 1.34 tokens per target forward, 1.05× the speed")
    speed, ranking, *_, step = grounds
    assert "1.05× (runs 0.95–3.30×) the speed of target-only greedy (too noisy to tell: the speedup ranges overlap)" \
        in speed
    assert ranking.startswith("**Too noisy to rank** the methods of `v` by speed: over 3 timed runs per prompt, the "
                              "speedup ranges overlap (")
    assert "a method's runs on one prompt differed by a median of 240% of their time" in ranking
    assert " > " not in ranking and "ranking of" not in ranking
    assert step.startswith("Next step: re-run the benchmark on a quiet machine or with more runs (`benchmark.repeats`)")
    # k: positions 2 and 3 accept nothing; with c = 0.3 the cost model prefers one draft token
    assert "another k: `benchmark.num_speculative_tokens: 1` (per-position acceptance 0.338 / 0.000 / 0.000" in step
    # and whether that k would beat target-only greedy: 1.05× measured at k = 3 times the model's gain 1.9 / 1.3
    assert ("gives 1.46× the speed of k = 3, about 1.53× target-only greedy (1.05× measured at k = 3): faster than "
            "target-only greedy)") in step
    for text in (render_markdown("t", verdict, [], {}, "figures", ""),
                 render_html("t", verdict, [], {}, tmp_path, "")):
        assert "Too noisy to rank" in text and not re.search(r"(draft|greedy|lookup) [\d.]+× \(runs [^)]*\) >", text)


def test_a_clear_slowdown_and_a_faster_prompt_lookup_are_said_plainly(tmp_path):
    slower = {**CLEAR, "eagle3_draft": method(0.85, 0.80, 0.91, acceptance=1.1, per_position=(0.1, 0.0, 0.0))}
    by_variant, methods = load(tmp_path, summary(slower))
    [(_, head, grounds)] = verdict_lines(by_variant, methods, predicted_table(pd.DataFrame(), methods, by_variant),
                                      DATA_SIZE)
    assert head.startswith("**`v`: do not use this draft: it slows decoding down** (acceptance 1.10 ")
    assert "(slower by 15%, the speedup ranges apart)" in grounds[0]
    assert "so the draft ran at 0.71× its speed (slower by 29%, the speedup ranges apart)" in grounds[0]
    lookup_wins = {**CLEAR, "eagle3_draft": method(1.1, 1.05, 1.12, acceptance=1.2, per_position=(0.2, 0.0, 0.0))}
    by_variant, methods = load(tmp_path, summary(lookup_wins))
    [(_, head, _)] = verdict_lines(by_variant, methods, predicted_table(pd.DataFrame(), methods, by_variant), DATA_SIZE)
    assert head.startswith("**`v`: prompt lookup is the better choice: it is faster than this draft and needs no "
                           "training** (")
    # prompt lookup clearly faster, the draft within the noise of target-only greedy: still prompt lookup's
    lookup_wins["eagle3_draft"] = method(1.02, 0.95, 1.1, acceptance=1.2, per_position=(0.2, 0.0, 0.0))
    by_variant, methods = load(tmp_path, summary(lookup_wins))
    [(_, head, _)] = verdict_lines(by_variant, methods, predicted_table(pd.DataFrame(), methods, by_variant), DATA_SIZE)
    assert head.startswith("**`v`: prompt lookup is the better choice")


def test_a_single_timed_run_is_read_as_unconfirmed(tmp_path):
    """The vLLM backend times one run per method: no range; the report still loads it and says the order is unconfirmed."""
    vllm = {"target_greedy": method(1.0, repeats=1), "eagle3_draft": method(1.4, acceptance=1.8, repeats=1,
                                                                            per_position=(0.5, 0.2, 0.1))}
    for entry in vllm.values():  # as vllm_benchmark writes them: no timing fields at all
        for key in ("repeats", "time_spread", "speedup_range"):
            del entry[key]
    by_variant, methods = load(tmp_path, summary(vllm, backend="vllm"))
    assert methods["speedup_low"].isna().all() and (methods["repeats"] == 1).all()
    [(_, head, grounds)] = verdict_lines(by_variant, methods, predicted_table(pd.DataFrame(), methods, by_variant),
                                      DATA_SIZE)
    assert head == ("**`v`: use this draft, unconfirmed: one timed run per method, so the machine's noise was not "
                    "measured** (acceptance 1.80 tokens per target forward, 1.40× the speed of target-only greedy).")
    assert "faster by 40% in a single timed run; the spread was not measured" in grounds[0]
    assert grounds[1] == ("Speed order of `v` by a single timed run per method (vllm backend; unconfirmed: the spread "
                          "was not measured): trained EAGLE-3 draft 1.40× > target-only greedy 1.00×.")


def test_validation_predicts_the_chain_acceptance_beside_the_measured_one(tmp_path):
    """speculators' full_acc_i is cumulative (steps 0..i all correct): 1 + a0 + a1 + a2 tokens per drafted round."""
    assert predicted_acceptance_length([0.776, 0.577, 0.439], 3) == pytest.approx(2.792)
    assert predicted_acceptance_length([0.776, 0.577, 0.439], 1) == pytest.approx(1.776)  # k = 1 drafts one token
    by_variant, methods = load(tmp_path, summary(NOISY))
    training = pd.DataFrame([{"variant": "v", "val full acc 0": 0.776, "val full acc 1": 0.577, "val full acc 2": 0.439}])
    predicted = predicted_table(training, methods, by_variant)
    assert predicted.loc[0, "predicted tokens per drafted round"] == pytest.approx(2.792)
    assert predicted.loc[0, "tokens per drafted round (benchmark)"] == pytest.approx(1.338)
    [(_, _, grounds)] = verdict_lines(by_variant, methods, predicted, DATA_SIZE)
    line = next(g for g in grounds if g.startswith("Validation predicted"))
    assert line.startswith("Validation predicted 2.79 tokens per drafted round (1 + the validation full accuracies "
                           "0.776 / 0.577 / 0.439); the benchmark measured 1.34 (per-position acceptance "
                           "0.338 / 0.000 / 0.000). The gap is not noise")


def test_best_k_from_per_position_acceptance():
    assert best_k([0.338, 0.0, 0.0], 3, 0.3) == (1, pytest.approx(1.338 / 1.3 / (1.338 / 1.9)))
    assert best_k([0.8, 0.7, 0.6], 3, 0.05)[0] == 3
    assert best_k([0.5, 0.05, 0.01], 3, None) == (1, None)  # without c: positions accepted in < 10% of drafts go


def test_a_shorter_k_says_whether_it_would_beat_greedy(tmp_path):
    """The CPU demo's case: the cost model favours k = 1, but the draft, 0.62× greedy at k = 3, stays slower at k = 1."""
    slow = {**CLEAR, "eagle3_draft": method(0.62, 0.6, 0.64, acceptance=1.05, per_position=(0.2, 0.05, 0.01),
                                            cost_ratio=0.3)}
    by_variant, methods = load(tmp_path, summary(slow))
    [(_, _, grounds)] = verdict_lines(by_variant, methods, predicted_table(pd.DataFrame(), methods, by_variant),
                                      DATA_SIZE)
    gain = (1.2 / 1.3) / (1.26 / 1.9)  # the cost model (1 + p1 + ... + pj) / (1 + j c) of k = 1 over k = 3
    assert (f"gives {gain:.2f}× the speed of k = 3, about {0.62 * gain:.2f}× target-only greedy (0.62× measured at "
            "k = 3): still slower than target-only greedy: a shorter chain alone does not make this draft pay)") \
        in grounds[-1]


def test_the_cpu_demo_caveat_only_for_the_workflows_own_target_on_a_cpu():
    from draftsmith.report.verdict import GPU_RESULT, cpu_demo_note

    cpu, gpu = {"device": "cpu: x86_64 (2 cores)"}, {"device": "cuda: NVIDIA H100 80GB HBM3"}
    note = cpu_demo_note({"default": cpu, "data_50": cpu}, {"target": {"model": "smollm2-135m-instruct"}})
    assert note.startswith("This is a CPU demo run (target `smollm2-135m-instruct`, built by the workflow")
    assert "a draft slower than target-only greedy is expected here" in note and GPU_RESULT in note
    assert cpu_demo_note({"default": cpu}, {"target": {"model": "embedded"}}) is not None
    assert cpu_demo_note({"default": gpu}, {"target": {"model": "smollm2-135m-instruct"}}) is None  # a GPU run
    assert cpu_demo_note({"default": cpu, "x": gpu}, {"target": {"model": "embedded"}}) is None
    assert cpu_demo_note({"default": cpu}, {"target": {"model": "meta-llama/Llama-3.1-8B-Instruct"}}) is None


def test_categories_with_fewer_than_three_prompts_are_marked_and_not_compared():
    rows = []
    for category, n in (("coding", 3), ("math", 1), ("writing", 4), ("roleplay", 2)):
        for i in range(n):
            for m, forwards in (("target_greedy", 12), ("eagle3_draft", {"math": 3, "writing": 4}.get(category, 6))):
                rows.append({"variant": "v", "method": m, "prompt_id": f"{category}{i}", "category": category,
                             "new_tokens": 12, "target_forwards": forwards})
    table = acceptance_by_category(pd.DataFrame(rows)).set_index("category")
    assert list(table.index) == ["coding", "math †", "roleplay †", "writing"]
    assert list(table["prompts"]) == [3, 1, 2, 4]
    lines = category_findings(table.reset_index())
    # math's 4.00 from one prompt is not the best category
    assert lines[0] == ("By prompt category, the trained EAGLE-3 draft (v) accepts most on `writing` (3.00) and least on "
                        "`coding` (2.00), among the categories with 3 or more prompts.")
    assert lines[1] == ("2 of 4 prompt categories have fewer than 3 prompts (marked †): their per-category figures rest "
                        "on too few prompts to compare categories.")


# ----------------------------------------------------------------------------- the real pipeline's report


def verdict_section(md: str) -> list[str]:
    return md.split("## Verdict\n\n", 1)[1].split("\n\n## ", 1)[0].splitlines()


def test_the_pipeline_report_opens_with_a_verdict_against_greedy_and_prompt_lookup(pipeline_run):
    """The tiny run's report: the first section is the verdict on its draft, with the speed against target-only greedy
    and prompt lookup in numbers, how sure (the runs' ranges), and a ranking only where the ranges allow one."""
    from draftsmith.io import read_json

    r = pipeline_run / "results"
    md = (r / "report" / "report.md").read_text()
    assert md.split("\n## ")[1].startswith("Verdict")  # before everything else
    lines = verdict_section(md)
    heads = ["use this draft: it speeds decoding up, more than prompt lookup does",
             "do not use this draft: it slows decoding down",
             "prompt lookup is the better choice: it is faster than this draft and needs no training",
             "this draft speeds decoding up; whether more than prompt lookup, the runs were too noisy to tell",
             "undecided: the machine was too noisy to tell whether this draft is faster than target-only greedy"]
    methods = read_json(r / "benchmark" / "default" / "summary.json")["methods"]
    draft, lookup = methods["eagle3_draft"], methods["prompt_lookup"]
    numbers = (f" (acceptance {draft['acceptance_length']:.2f} tokens per target forward, {draft['speedup']:.2f}× the "
               f"speed of target-only greedy).")
    assert lines[0] in [f"- **`default`: {h}**{numbers}" for h in heads], lines[0]  # the one-line verdict first
    assert lines[2].startswith("This is a CPU demo run (target `embedded`, built by the workflow, benchmarked on a CPU")
    assert "a draft slower than target-only greedy is expected here" in lines[2] and "README.md" in lines[2]
    assert lines[3:6] == ["", "### `default`: the grounds", ""]  # the detail below it
    lines = [""] + lines[6:]
    low, high = draft["speedup_range"]
    speed = lines[1]
    assert speed.startswith(f"- Speed: the trained draft ran at {draft['speedup']:.2f}× (runs {low:.2f}–{high:.2f}×) "
                            f"the speed of target-only greedy (")
    assert (f"prompt lookup ran at {lookup['speedup']:.2f}× (runs {lookup['speedup_range'][0]:.2f}–"
            f"{lookup['speedup_range'][1]:.2f}×), so the draft ran at {draft['speedup'] / lookup['speedup']:.2f}× its "
            f"speed (") in speed
    assert re.search(r"(faster|slower) by \d+%, the speedup ranges apart|too noisy to tell", speed)
    assert "3 prompts, 2 timed runs each (median), the methods interleaved" in speed
    ranking = lines[2]
    if ranking.startswith("- **Too noisy to rank**"):
        assert " > " not in ranking
    else:
        assert ranking.startswith("- Speed ranking of `default`") and ranking.count(" > ") == 3
    assert any(x.startswith("- Validation predicted ") and "tokens per drafted round" in x for x in lines)
    assert lines[-1].startswith("- Next step: ")
    html = (r / "report" / "report.html").read_text()
    assert "<h2 id='verdict'>Verdict</h2>" in html and html.index("id='verdict'") < html.index("id='what-this-means'")


def test_the_pipeline_report_leaves_out_figures_with_nothing_to_show(pipeline_run):
    """The tiny run measures one batch size and trains one variant: no empty "Throughput under load" or learning-curve
    axes, a line saying why in their place; every other figure is drawn."""
    from draftsmith.report.figures import FIGURES

    report = pipeline_run / "results" / "report"
    md, html = (report / "report.md").read_text(), (report / "report.html").read_text()
    left_out = {"speedup_by_batch_size": "one batch size measured per variant (1), so there is no curve to draw: set "
                                         "`benchmark.batch_sizes` (e.g. [1, 4, 16, 64])",
                "data_size": "every benchmarked draft trained on the same amount of data, so there is no curve to draw"}
    for name, why in left_out.items():
        assert f"\n*Figure left out ({FIGURES[name]}): {why}" in md
        assert f"<p class='left-out' id='figure-{name}'>Figure left out ({FIGURES[name]}): " in html
    assert sorted(p.stem for p in (report / "figures").glob("*.png")) == sorted(set(FIGURES) - set(left_out))


def test_the_pipeline_report_marks_categories_with_fewer_than_three_prompts(pipeline_run):
    r = pipeline_run / "results"
    per_prompt = pd.read_csv(r / "benchmark" / "default" / "per_prompt.csv")
    counts = per_prompt[per_prompt["method"] == "target_greedy"].groupby("category")["prompt_id"].nunique()
    md = (r / "report" / "report.md").read_text()
    table = md.split("## Acceptance length per prompt category\n\n", 1)[1].split("\n\n", 2)[1]
    shown = [row.split("|")[1].strip() for row in table.splitlines()[2:]]
    assert shown == [f"{c} †" if n < 3 else c for c, n in counts.items()]
    assert any(n < 3 for n in counts)  # the tiny run's 3 prompts spread over its categories


def test_no_table_of_the_pipeline_report_is_wider_than_the_page(pipeline_run, tmp_path):
    """No column of full sha256 values; a cell with a long unbroken word may wrap anywhere; and, where a headless
    Chromium is installed, every table fits the page in a 1400 px wide window."""
    import shutil
    import subprocess

    html = (pipeline_run / "results" / "report" / "report.html").read_text()
    tables = re.findall(r"<table id='([^']+)'>(.*?)</table>", html, re.S)
    assert len(tables) >= 10
    for table_id, body in tables:
        for cell_class, text in re.findall(r"<td( class='long')?>(.*?)</td>", body, re.S):
            assert not re.search(r"\b[0-9a-f]{64}\b", text), (table_id, text)  # sha256 values are shortened
            if any(len(word) > 24 for word in text.split()):
                assert cell_class, (table_id, text)
    assert "max-width:100%" in html and "td.long{overflow-wrap:anywhere" in html
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no headless Chromium here: the structural checks above stand in for the rendered one")
    measure = ("<script>const b=document.body.getBoundingClientRect(),s=getComputedStyle(document.body);"
               "const right=b.right-parseFloat(s.paddingRight);const p=document.createElement('pre');p.id='widths';"
               "p.textContent=[...document.querySelectorAll('table')].map(t=>t.id+' '+(t.getBoundingClientRect().right"
               "-right)).join(';')+'|'+(document.documentElement.scrollWidth-document.documentElement.clientWidth);"
               "document.body.appendChild(p);</script>")
    page = tmp_path / "report.html"
    page.write_text(html.replace("</body>", measure + "</body>"))
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    overflow, page_overflow = re.search(r"<pre id=\"widths\">([^<]*)</pre>", dom).group(1).split("|")
    beyond = {t.split()[0]: float(t.split()[1]) for t in overflow.split(";")}
    assert len(beyond) == len(tables) and all(px <= 0.5 for px in beyond.values()), beyond
    assert int(page_overflow) <= 0


def swept(*speedups, backend="vllm") -> dict:
    """A summary measured at batch sizes 1, 4, 16, ... with the draft's speedups as given."""
    from draftsmith.benchmark.results import pays_up_to

    sizes = [1, 4, 16, 64][:len(speedups)]
    per_size = {str(s): {"tokens_per_s": 10 * s * x, "speedup": x, "acceptance_length": 2.0} for s, x in zip(sizes, speedups)}
    for s in sizes[1:]:  # the step costs with that many rows at once (batch 1's are the method's own)
        per_size[str(s)]["step_costs"] = {"target_step_ms": 3.0 + s, "verify_step_ms": 2 * (3.0 + s), "draft_step_ms": 0.3,
                                          "cost_ratio": 0.3 / (3.0 + s)}
    greedy = {str(s): {"tokens_per_s": 10 * s, "speedup": 1.0, "acceptance_length": 1.0} for s in sizes}
    s = summary({"target_greedy": {**method(1.0, 1.0, 1.0), "per_batch_size": greedy},
                 "eagle3_draft": {**method(speedups[0], acceptance=2.0), "per_batch_size": per_size,
                                  "pays_up_to": pays_up_to(per_size)}}, backend)
    return {**s, "batch_sizes": sizes}


@pytest.mark.parametrize("speedups, sentence", [
    ((1.45, 1.12, 0.9), "the trained draft beats target-only greedy up to concurrency 4 (1.45× at 1, 1.12× at 4); at 16 "
                        "it is 0.90×."),
    ((1.45, 0.9, 0.95, 1.05), "the trained draft beats target-only greedy up to concurrency 1 (1.45× at 1); at 4 it is "
                              "0.90×, though above 1 again at 64."),
    ((1.3, 1.2, 1.1, 1.02), "the trained draft beats target-only greedy at every measured concurrency, up to 64 (1.30× "
                            "at 1, 1.02× at 64)."),
    ((0.95, 0.8), "the trained draft does not beat target-only greedy even at concurrency 1 (0.95×); at 4 it is 0.80×."),
])
def test_the_report_says_where_the_draft_stops_paying(tmp_path, speedups, sentence):
    from draftsmith.report.load import load_batch_sizes
    from draftsmith.report.tables import findings, load_findings, load_table

    by_variant, methods = load(tmp_path, swept(*speedups))
    batch = load_batch_sizes(by_variant)
    assert load_findings(batch) == [f"`v` (vllm backend) under load: {sentence}"]
    lines = findings(by_variant, methods, pd.DataFrame(columns=["records_kept"]), pd.DataFrame(columns=["variant"]),
                     pd.DataFrame(), DATA_SIZE, batch)
    assert f"`v` (vllm backend) under load: {sentence}" in lines
    table = load_table(batch)
    assert list(table.columns) == ["variant", "backend", "method", "concurrency", "tokens/s", "speedup", "acceptance length",
                                   "time to first token p50 (ms)", "time per output token p50 (ms)", "p90 (ms)",
                                   "time in refills", "v = verification / target step", "c = draft step / target step"]
    drafted = table[table["method"] == "eagle3_draft"]
    assert list(drafted["speedup"]) == list(speedups)
    assert list(drafted["v = verification / target step"])[1:] == [2.0] * (len(speedups) - 1)
    assert list(drafted["c = draft step / target step"])[1:] == [0.3 / (3.0 + s) for s in [4, 16, 64][:len(speedups) - 1]]
    assert table[table["method"] == "target_greedy"]["v = verification / target step"].isna().all()
    assert table["time per output token p50 (ms)"].isna().all()  # these summaries hold no latency: unknown, not 0
    assert table["time in refills"].isna().all()  # nor refills (vLLM schedules its own)


def test_one_batch_size_says_nothing_about_load(tmp_path):
    from draftsmith.report.load import load_batch_sizes
    from draftsmith.report.tables import load_findings

    by_variant, _ = load(tmp_path, swept(1.4))
    assert load_findings(load_batch_sizes(by_variant)) == []
