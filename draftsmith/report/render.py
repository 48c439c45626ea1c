"""Rendering the report: self-contained HTML (figures embedded) and Markdown (figures linked)."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import pandas as pd

from draftsmith.report.figures import FIGURES
from draftsmith.report.tables import FEW_MARK, MIN_CATEGORY_PROMPTS, display

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{border-bottom:2px solid #444}h2{margin-top:2em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em;max-width:100%}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right;vertical-align:top}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
td.long{overflow-wrap:anywhere;text-align:left;font-size:.92em}
.findings{background:#f6f8fa;border-left:4px solid #4c72b0;padding:.5em 1em}
.verdict{background:#fff8e6;border-left:4px solid #dd8452;padding:.5em 1em}.verdict h3{font-size:1em}
.left-out{font-style:italic;color:#555}
details{margin:0 0 1.5em}details pre{white-space:pre-wrap;overflow-wrap:anywhere}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.9em;color:#555}
pre{background:#f6f8fa;padding:1em;overflow-x:auto;font-size:.85em}
code{font-size:.9em}
"""

SECTIONS = [
    ("summary", "Benchmark summary",
     "Acceptance length = generated tokens per target forward (the bonus token included). Per-position "
     "acceptance = fraction of drafts whose first i tokens were all accepted; tokens per drafted round = 1 + "
     "accepted draft tokens per draft (the acceptance length papers report). Speedup = tokens/s over "
     "target-only greedy decoding on the same prompts, from each prompt's median time over its timed runs."),
    ("speed", "Timing and how far to trust it",
     "The offline backend decodes each prompt benchmark.repeats times with every method after an untimed warm-up, "
     "the methods interleaved in an order rotated per prompt and run; a prompt's time is the median of its runs. "
     "Speedup range = the lowest and highest speedup of a single run over all prompts (with the median-based "
     "speedup): methods are ranked only where these ranges are apart. Timing spread = (slowest - fastest run) / "
     "median run of one prompt, the median over prompts. After the first token = the speedup of the tokens after "
     "each prompt's first (the prompt's forward, paid once by every method, left out; offline only). c and "
     "τ/(1+k·c): the cost model of a round (k draft steps and one target step), from the median of 20 timed steps; "
     "v and τ/(v+k·c): the same with the round's verification over k + 1 tokens (v one-token steps, timed the same "
     "way) in place of one target step: what the verification's width costs. Each step is timed on its own with a "
     "host sync, so the models are estimates: on one H100 τ/(v+k·c) came within 3% of the measured speedup. "
     "A vLLM benchmark times one run per method: its spread and range are unknown (—)."),
    ("load", "Throughput under load",
     "Total generated tokens/s of every method at each concurrency of benchmark.batch_sizes (requests in flight: vllm "
     "against one server per method; offline with refill, a row taking the next prompt as its answer ends), the speedup "
     "over target-only greedy at the same concurrency, acceptance length (at a vLLM size above 1 from the server's "
     "spec-decode counters over the size), and per request the time to its first token (from its admission) and the time "
     "per output token after it (offline). The summary's figures are those of the smallest size."),
    ("predicted", "What validation predicted, what the benchmark measured",
     "Validation full accuracy of TTT step i (training, last validation row) = the fraction of held-out training "
     "positions where the draft's tokens of steps 0..i were all the target's greedy tokens, the draft fed the "
     "target's hidden states of the training text. Per-position acceptance i + 1 is the same fraction measured while "
     "decoding the benchmark prompts. So validation predicts 1 + a0 + a1 + ... tokens per drafted round (the "
     "accuracies are cumulative: in conditional accuracies c, 1 + c0 + c0·c1 + ...). Both are counts, not timings: a "
     "gap means the benchmark prompts differ from the training data, or training and decoding disagree."),
    ("categories", "Acceptance length per prompt category",
     "Generated tokens per target forward over each category's prompts (MT-Bench's categories, or the "
     "synthetic task families), per method and variant; prompts = prompts in the category. "
     f"{FEW_MARK} fewer than {MIN_CATEGORY_PROMPTS} prompts: too few for the category's figure to stand for the "
     "category, and left out when categories are compared."),
    ("data_size", "Learning curve: training data, predicted and measured acceptance",
     "Each variant's training set (the datasets it trains on, and data_fraction of their training samples; "
     "variants on the same datasets share their validation samples); its last validation's full accuracy per TTT "
     "step and the acceptance length those predict for the benchmark's chain of k draft tokens (1 + a0 + ... + "
     "a(k-1) tokens per drafted round, the same formula as predicted_acceptance_length in metrics.csv); and what "
     "the benchmark measured with the trained draft: acceptance length (tokens per target forward; each prompt's "
     "forward counts, so it is a little below tokens per drafted round, the prediction's counterpart) and speedup "
     "over target-only greedy. The same rows, unrounded, are learning_curve.csv beside report.md."),
    ("training", "Training (final values)", "Validation rows are per-epoch averages."),
    ("drafts", "Draft checkpoints", "From each draft's speculators config.json."),
    ("data", "Data", "Records read per dataset (from the raw data, for a regenerated dataset too; for prompts the target "
              "wrote itself, the candidates it wrote), dropped by regenerate before the target answered (for those "
              "prompts also by their checks: self_prompts reasons) and skipped by prepare (each by reason), kept, and "
              "tokens after truncation."),
    ("versions", "Package versions and devices", ""),
    ("inputs", "Input files", "Every file this report was built from, with the first digits of its sha256; the "
                               "full checksums follow, for sha256sum -c."),
]
# sections shown only when their table exists, after the section named second
OPTIONAL_SECTIONS = [
    ("shards", "data", "Hidden-state shards",
     "One row per shard; the manifest checksum covers the sha256 of every sample file it lists. (None where "
     "training.hidden_states is online: the target computed the states during training.)"),
    ("stages", "data", "Time per stage",
     "Each rule's jobs from Snakemake's benchmark files (benchmarks/ beside the results): their wall seconds summed "
     "and the longest, and the largest peak resident memory of any of them. On one GPU (resources gpu=1) the GPU "
     "stages run one at a time, so their sums are their share of the run's wall time."),
    ("backends", "summary", "Offline and vLLM acceptance side by side",
     "The same draft on the same prompts with draftsmith's offline loop and with vllm serve "
     "(benchmark.offline_reference); in float32 their draft and accept counters should be equal prompt by prompt."),
]
FIGURE_SECTIONS = {
    "summary": ["acceptance_length", "per_position_acceptance", "throughput"],
    "load": ["speedup_by_batch_size"],
    "categories": ["acceptance_by_category"],
    "data_size": ["data_size"],
    "training": ["training_loss", "training_accuracy"],
    "data": ["data_stats"],
}


def sections(tables: dict) -> list[tuple[str, str, str]]:
    """SECTIONS whose table exists, with each optional section whose table exists placed after its anchor."""
    out = []
    for section in SECTIONS:
        if section[0] in tables:
            out.append(section)
        out += [(key, heading, note) for key, after, heading, note in OPTIONAL_SECTIONS if after == section[0] and key in tables]
    return out


def _md_inline(text: str) -> str:
    """Markdown to HTML for the few inline marks the findings use (`code`, **bold**)."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


# a cell this long without a space gets class "long": it may break anywhere, so its table fits the page
LONG_CELL = 24


def html_table(df: pd.DataFrame, table_id: str) -> str:
    """A display table as HTML; cells with long unbroken text (paths, ids) wrap anywhere instead of widening it."""
    shown = display(df)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in shown.columns)
    rows = []
    for values in shown.itertuples(index=False, name=None):
        cells = []
        for v in values:
            long = any(len(word) > LONG_CELL for word in v.split())
            cells.append(f"<td class='long'>{html.escape(v)}</td>" if long else f"<td>{html.escape(v)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f"<table id='{table_id}'>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(rows)
            + "\n</tbody>\n</table>")


Verdict = list[tuple[str, str, list[str]]]  # per variant: (variant, its one-line verdict, the grounds)


def left_out_line(name: str, why: str) -> str:
    """What stands where a figure with nothing to show would be (draftsmith.report.figures.draw_figures)."""
    return f"Figure left out ({FIGURES[name]}): {why}."


def render_html(title: str, verdict: Verdict, lines: list[str], tables: dict[str, pd.DataFrame], figures_dir: Path,
                config_yaml: str, checksums: str = "", notes: list[str] = (),
                left_out: dict[str, str] | None = None) -> str:
    """`notes`: lines shown under the verdicts (the CPU-demo caveat); `left_out`: figures not drawn, with why."""
    left_out = left_out or {}
    parts = [f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             "<h2 id='verdict'>Verdict</h2><div class='verdict'><ul>"]
    parts += [f"<li>{_md_inline(head)}</li>" for _, head, _ in verdict]
    parts.append("</ul>" + "".join(f"<p>{_md_inline(n)}</p>" for n in notes))
    for variant, _, grounds in verdict:
        parts.append(f"<h3>{_md_inline(f'`{variant}`: the grounds')}</h3><ul>"
                     + "".join(f"<li>{_md_inline(g)}</li>" for g in grounds) + "</ul>")
    parts.append("</div>")
    parts.append("<h2 id='what-this-means'>What this means</h2><div class='findings'><ul>")
    parts += [f"<li>{_md_inline(line)}</li>" for line in lines]
    parts.append("</ul></div>")
    for key, heading, note in sections(tables):
        parts.append(f"<h2 id='{key}'>{html.escape(heading)}</h2>")
        if note:
            parts.append(f"<p>{html.escape(note)}</p>")
        parts.append(html_table(tables[key], f"table-{key}"))
        if key == "inputs" and checksums:
            parts.append(f"<details id='checksums'><summary>Full sha256 of every input</summary>"
                         f"<pre>{html.escape(checksums)}</pre></details>")
        for name in FIGURE_SECTIONS.get(key, []):
            if name in left_out:
                why = html.escape(left_out_line(name, left_out[name]))
                parts.append(f"<p class='left-out' id='figure-{name}'>{why}</p>")
                continue
            data = base64.b64encode((figures_dir / f"{name}.png").read_bytes()).decode("ascii")
            parts.append(f"<figure id='figure-{name}'><img alt='{html.escape(FIGURES[name])}' "
                         f"src='data:image/png;base64,{data}'><figcaption>{html.escape(FIGURES[name])}"
                         f"</figcaption></figure>")
    parts.append(f"<h2 id='config'>Workflow configuration</h2><pre>{html.escape(config_yaml)}</pre>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, verdict: Verdict, lines: list[str], tables: dict[str, pd.DataFrame], figures_rel: str,
                    config_yaml: str, checksums: str = "", notes: list[str] = (),
                    left_out: dict[str, str] | None = None) -> str:
    """The same as render_html, figures linked from `figures_rel`."""
    left_out = left_out or {}
    parts = [f"# {title}", "", "## Verdict", ""] + [f"- {head}" for _, head, _ in verdict]
    for note in notes:
        parts += ["", note]
    for variant, _, grounds in verdict:
        parts += ["", f"### `{variant}`: the grounds", ""] + [f"- {g}" for g in grounds]
    parts += ["", "## What this means", ""] + [f"- {line}" for line in lines]
    for key, heading, note in sections(tables):
        parts += ["", f"## {heading}", ""]
        if note:
            parts += [note, ""]
        parts.append(display(tables[key]).map(_md_cell).to_markdown(index=False, disable_numparse=True))
        if key == "inputs" and checksums:
            parts += ["", "Full sha256 of every input:", "", "```", checksums.rstrip(), "```"]
        for name in FIGURE_SECTIONS.get(key, []):
            parts += ["", f"*{left_out_line(name, left_out[name])}*" if name in left_out
                      else f"![{FIGURES[name]}]({figures_rel}/{name}.png)"]
    parts += ["", "## Workflow configuration", "", "```yaml", config_yaml.rstrip(), "```", ""]
    return "\n".join(parts)


def plain_config(config) -> dict:
    """The config as plain YAML-safe data (Snakemake hands in its own dict subclass)."""
    return json.loads(json.dumps(config, default=str))
